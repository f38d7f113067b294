# shellcheck shell=bash
# Sourced by bench-proxy.sh and bench-ab.sh: the nginx that stands in for a model server, and
# the wrk script both drive the routers with.

# write_nginx_conf DIR PORT: a one-worker nginx configuration in DIR/nginx.conf, listening on
# 127.0.0.1:PORT, answering every POST /v1/chat/completions with one fixed 230-byte chat
# completion (with a `usage` object) and `{"status":"ok"}` on any other path.
write_nginx_conf() {
    local dir=$1 port=$2
    mkdir -p "$dir"
    cat >"$dir/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $dir/body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    server {
        listen 127.0.0.1:$port;
        default_type application/json;
        location / { return 200 '{"status":"ok"}'; }
        location = /v1/chat/completions {
            return 200 '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}';
        }
    }
}
EOF
}

# write_bench_lua FILE SESSIONS: wrk's script, POST /v1/chat/completions cycling through
# SESSIONS sessions (each named in the X-Session-Id header and in the body), printing one
# RESULT line (requests, duration, p50, p99, errors) when done.
write_bench_lua() {
    local file=$1 sessions=$2
    cat >"$file" <<EOF
-- POST /v1/chat/completions, cycling through $sessions sessions (header and body name it).
local n = $sessions
local reqs = {}
local i = 0
function init(args)
    for s = 0, n - 1 do
        local id = string.format("session-%05d", s)
        local body = '{"model":"m","messages":[{"role":"user","content":"' .. id ..
            ': say ok"}],"max_tokens":1,"stream":false}'
        reqs[s] = wrk.format("POST", "/v1/chat/completions",
            { ["Content-Type"] = "application/json", ["X-Session-Id"] = id }, body)
    end
    i = math.random(0, n - 1)
end
function request()
    i = (i + 1) % n
    return reqs[i]
end
function done(summary, latency, requests)
    local e = summary.errors
    io.write(string.format("RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d " ..
        "errors=%d non2xx=%d\n", summary.requests, summary.duration,
        latency:percentile(50), latency:percentile(99),
        e.connect + e.read + e.write + e.timeout, e.status))
end
EOF
}
