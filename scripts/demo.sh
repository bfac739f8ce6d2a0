#!/usr/bin/env bash
# kvpn demo on the built-in lab: every line below is a real command with its real
# output. Run through `./x demo` (which builds first and sets KVPN_BIN_DIR).
set -uo pipefail

BIN="${KVPN_BIN_DIR:?run this through ./x demo}"
BUILD="${KVPN_DEMO_BUILD:-unknown}"
# `--real-nodes` (./x demo --real-nodes): the lab on real node software.
LAB_UP_ARGS="${KVPN_DEMO_LAB_UP_ARGS:-}"
export PATH="$BIN:$PATH"
# The demo's daemons live in the lab's laptop netns, in the runtime folder
# `kvpn lab exec laptop` gives them (never a kvpn daemon of the real machine);
# `kvpn lab down` stops them and removes that folder.

bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
show() { printf '\033[36m$ %s\033[0m\n' "$*"; "$@"; }
laptop() { kvpn lab exec laptop -- "$@"; }
failures=0
expect_ok() { if "$@"; then :; else echo "!! unexpected failure: $*"; failures=$((failures+1)); fi; }
expect_fail() { if "$@"; then echo "!! unexpectedly succeeded: $*"; failures=$((failures+1)); else echo "(failed, as it should)"; fi; }

cleanup() {
    kvpn lab exec laptop -- kvpn disconnect --all >/dev/null 2>&1
    kvpn lab exec laptop -- kvpn quit >/dev/null 2>&1
    kvpn lab down >/dev/null 2>&1
}
trap cleanup EXIT

if [ "$BUILD" = release ]; then
    bold "kvpn build: release ($BIN), the build the benchmarks measure"
else
    bold "kvpn build: $BUILD ($BIN) -- NOT the release build: throughput and latency below are several times worse than what kvpn does; \`./x demo\` without --debug runs release (see the README's benchmarks)"
fi

bold "1. Bring up the lab: a laptop, a Kubernetes control plane, nodes (two real ones: containerd, kubelet, kube-proxy), pods, ClusterIPs, cluster DNS"
kvpn lab down >/dev/null 2>&1
# shellcheck disable=SC2086 # LAB_UP_ARGS is a list of flags
show kvpn lab up $LAB_UP_ARGS || exit 1
# The laptop's kubeconfig for the restricted user kvpn-user (only what kvpn needs).
KUBECONFIG_USER=$(kvpn lab info | grep -o '/[^ ]*laptop-kvpn-user.kubeconfig' | head -n1)
[ -n "$KUBECONFIG_USER" ] || { echo "no laptop kubeconfig"; exit 1; }
show laptop kubectl get pods -A -o wide
# The two default/web pods (their IPs come from the kubelet stand-in, or from the
# CNI plugin on real nodes).
web_pod() { laptop kubectl get pods -n default -l app=web -o "jsonpath={.items[$1].$2}"; }
POD1=$(web_pod 0 status.podIP); POD2=$(web_pod 1 status.podIP); POD1_NAME=$(web_pod 0 metadata.name)
[ -n "$POD1" ] && [ -n "$POD2" ] && [ -n "$POD1_NAME" ] || { echo "no web pods"; exit 1; }

bold "2. Before connecting, the laptop has no route to the cluster"
expect_fail show laptop curl -sS --max-time 2 http://$POD1:8080/

bold "3. Connect with only a kubeconfig: kvpn installs the traffic manager, detects the CIDRs, port-forwards through the API server"
show laptop kvpn connect --kubeconfig "$KUBECONFIG_USER" || exit 1
show laptop kubectl get deploy,svc,secret,configmap -n kvpn-system -l app.kubernetes.io/managed-by=kvpn
show laptop ip -br addr show dev kvpn0
show laptop ip route show dev kvpn0

bold "4. A pod IP, over TCP"
expect_ok show laptop curl -sS --max-time 5 http://$POD1:8080/

bold "5. A ClusterIP (kube-proxy's DNAT balances over both backends)"
for i in 1 2 3 4; do
    expect_ok show laptop curl -sS --max-time 5 http://10.96.0.100/
done

bold "6. Service names: kvpn's DNS forwarder sends cluster names to the cluster DNS, everything else to the laptop's own nameservers"
show laptop cat /etc/resolv.conf
dig_web() { out=$(laptop dig +short web.default.svc.cluster.local); echo "$ dig +short web.default.svc.cluster.local"; echo "$out"; [ "$out" = "10.96.0.100" ]; }
expect_ok dig_web
expect_ok show laptop getent hosts web.default
expect_ok show laptop curl -sS --max-time 5 http://web.default/

bold "7. UDP echo through the ClusterIP of the udp-echo service"
udp_echo() { reply=$(laptop bash -c 'echo "hello over UDP" | socat -t 2 - UDP:10.96.0.102:7'); echo "reply: ${reply:-<none>}"; [ "$reply" = "hello over UDP" ]; }
expect_ok udp_echo

bold "8. ICMP: a pod answers; an unused pod IP does not (no fake replies)"
expect_ok show laptop ping -c 3 -i 0.2 -W 2 $POD2
expect_fail show laptop ping -c 1 -W 2 10.244.1.99

bold "9. A 50 MB download through the tunnel, checked by sha256 against the same file fetched inside the pod"
sum_tunnel() { laptop bash -c "curl -sS --max-time 60 http://$POD1:8080/big | sha256sum" | cut -d' ' -f1; }
sum_pod() { kvpn lab exec "$POD1_NAME" -- bash -c 'curl -sS --max-time 60 http://127.0.0.1:8080/big | sha256sum' | cut -d' ' -f1; }
check_download() {
    local start end a b
    start=$(date +%s.%N); a=$(sum_tunnel); end=$(date +%s.%N)
    b=$(sum_pod)
    echo "through kvpn: $a ($(echo "scale=1; 52428800*8/($end-$start)/1000000" | bc) Mbit/s, $BUILD build)"
    echo "inside pod:   $b"
    [ -n "$a" ] && [ "$a" = "$b" ]
}
expect_ok check_download

bold "10. Status, with the eBPF classifier's per-kind counters; kvpn top during a download"
expect_ok show laptop kvpn status
# `kvpn top --once` while downloads run: the pod route's row has a packet rate
# (outbound: the laptop's ACKs; the eBPF classifier counts laptop → cluster).
top_during_download() {
    laptop bash -c "for i in 1 2 3; do curl -sS --max-time 20 -o /dev/null http://$POD1:8080/big; done" &
    local dl=$! out
    sleep 1
    printf '\033[36m$ %s\033[0m\n' "kvpn top --once   (during a download from $POD1)"
    out=$(laptop kvpn top --once)
    echo "$out"
    wait "$dl"
    # Columns: SESSION TUN ROUTE KIND RATE(value unit) PKT/S …
    echo "$out" | awk '$3 ~ /^10\.244\./ && $4 == "pod" && $7 + 0 > 0 { found = 1 } END { exit !found }'
}
expect_ok top_during_download
# The data channel is TLS 1.3 inside the port-forward; the manager's own log says so.
manager_tls() { echo "$ kubectl logs -n kvpn-system deploy/kvpn-manager | grep tls"; laptop kubectl logs -n kvpn-system deploy/kvpn-manager | grep 'security=tls\|security="tls"'; }
expect_ok manager_tls

bold "11. Disconnect: the TUN device, routes, eBPF program and DNS settings are gone, and so is the cluster"
expect_ok show laptop kvpn disconnect --all
expect_fail show laptop curl -sS --max-time 2 http://$POD1:8080/
show laptop ip -br link show type tun
# The laptop's resolv.conf is back, byte for byte.
show laptop cat /etc/resolv.conf

bold "12. Clean up: stop the daemons, remove kvpn's objects from the cluster, tear the lab down"
show laptop kvpn quit
expect_ok show laptop kvpn uninstall --kubeconfig "$KUBECONFIG_USER"
show kvpn lab down
trap - EXIT
if [ "$failures" -ne 0 ]; then
    echo "demo: $failures step(s) did not behave as expected"
    exit 1
fi
bold "Demo complete: every step behaved as expected."
