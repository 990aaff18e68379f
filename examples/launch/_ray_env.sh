# Sourced by the launch recipes: settings shared by every node and by the job submitter. Override any of them in the
# environment before running a recipe.

# Ray's root for logs, sockets and spilled objects. Logs and spilling fill /tmp on long runs: point this at a roomy
# local disk. Keep the path short: Ray puts Unix sockets under it and a socket path may not exceed 107 bytes.
: "${RAY_TMP:=/tmp/ray}"
: "${RAY_PORT:=6379}"
: "${DASHBOARD_PORT:=8265}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"

# Ray 2.60 supports token authentication. Every node and every client (driver, `ray job submit`) needs the same
# RAY_AUTH_MODE and token. Default here: token mode, with the token from ~/.ray/auth_token (created on first use; a
# shared home directory shares it) unless RAY_AUTH_TOKEN is already set. On a closed, single-user machine you may
# export RAY_AUTH_MODE=disabled instead.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
if [ "$RAY_AUTH_MODE" = "token" ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  RAY_AUTH_TOKEN="$(ray get-auth-token --generate 2>/dev/null)"
  export RAY_AUTH_TOKEN
fi

# Block until the cluster at $RAY_ADDRESS has $1 alive nodes (timeout $2 seconds, default 300).
wait_for_nodes() {
  python "$(dirname "${BASH_SOURCE[0]}")/wait_for_nodes.py" --nodes "$1" --timeout "${2:-300}"
}
