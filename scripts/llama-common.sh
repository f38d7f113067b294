# Sourced by the scripts that run the llama-server `scripts/e2e-llama.sh --setup-only` cached
# (llama-slots.sh, llama-context.sh, estimate-error.sh): where it is, a check that it is
# there, and a wait for a server to answer.

CACHE="${TA_CACHE_DIR:-$HOME/.cache/tower-affinity}"
BIN="$CACHE/bin"
MODEL="$CACHE/models/gemma-3-270m-q4_k_m.gguf"

[[ -x "$BIN/llama-server" && -f "$MODEL" ]] || {
    echo "no cached llama-server or model in $CACHE: run scripts/e2e-llama.sh --setup-only first" >&2
    exit 2
}

# wait_up URL: until URL answers 200 (two minutes at most); fails otherwise.
wait_up() {
    for _ in $(seq 1 240); do
        curl -s -m 2 -o /dev/null -w '%{http_code}' "$1" | grep -q 200 && return 0
        sleep 0.5
    done
    echo "no answer from $1" >&2
    return 1
}
