# Sourced by bench-proxy.sh and bench-ab.sh: the nginx that stands in for a model server.

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
