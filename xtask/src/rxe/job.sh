# Body of the per-run /rxe-run/job.sh, run by /bin/sh (the host's) chrooted
# into the host's userspace inside the guest. `cargo xtask rxe` writes the
# variables (RXE_*), the exported environment and `set -- COMMAND...` above
# this text. The status line written to /rxe-run/status is how the host learns
# how the run ended: `exit N` or `setup-failed WHAT`.

status() { echo "$*" > /rxe-run/status; }
setup_failed() {
    echo "rxe-guest: set-up failed: $*" >&2
    status "setup-failed $*"
    exit 0
}

ip link set lo up || setup_failed "ip link set lo up"
if [ "$RXE_HOSTS" = 1 ]; then
    ip link add "$RDMA_TEST_NETDEV" type dummy || setup_failed "ip link add $RDMA_TEST_NETDEV type dummy"
fi
ip link set "$RDMA_TEST_NETDEV" mtu "$RXE_MTU" || setup_failed "ip link set $RDMA_TEST_NETDEV mtu $RXE_MTU"
ip addr add "$RDMA_TEST_IP/24" dev "$RDMA_TEST_NETDEV" || setup_failed "ip addr add $RDMA_TEST_IP/24 dev $RDMA_TEST_NETDEV"
# The same host over IPv6 (fd77::1 for 10.77.0.1), for the IPv6 tests,
# without duplicate-address detection so that it is usable at once, and
# kept while tests take the link down and up (Linux drops IPv6 addresses on
# down otherwise). Not fatal: a test that needs it fails, saying it is missing.
echo 1 > "/proc/sys/net/ipv6/conf/$RDMA_TEST_NETDEV/keep_addr_on_down" 2>/dev/null
if ip -6 addr add "fd77::${RDMA_TEST_IP##*.}/64" dev "$RDMA_TEST_NETDEV" nodad; then
    export RDMA_TEST_IP6="fd77::${RDMA_TEST_IP##*.}"
else
    echo "rxe-guest: no IPv6 address on $RDMA_TEST_NETDEV: IPv6 tests will fail" >&2
fi
ip link set "$RDMA_TEST_NETDEV" up || setup_failed "ip link set $RDMA_TEST_NETDEV up"
rdma link add "$RDMA_TEST_DEVICE" type rxe netdev "$RDMA_TEST_NETDEV" \
    || setup_failed "rdma link add $RDMA_TEST_DEVICE type rxe netdev $RDMA_TEST_NETDEV"

tries=0
until grep -q ACTIVE "/sys/class/infiniband/$RDMA_TEST_DEVICE/ports/1/state" 2>/dev/null; do
    tries=$((tries + 1))
    [ "$tries" -ge 100 ] && setup_failed "port 1 of $RDMA_TEST_DEVICE did not become ACTIVE in 10 s"
    sleep 0.1
done

if [ "$RXE_HOSTS" = 2 ]; then
    # Both guests boot at their own pace: wait until the peer answers on the
    # link, so the command starts with a working wire.
    tries=0
    until busybox ping -c 1 -W 1 "$RDMA_TEST_PEER_IP" > /dev/null 2>&1; do
        tries=$((tries + 1))
        [ "$tries" -ge "$RXE_PEER_WAIT" ] \
            && setup_failed "peer $RDMA_TEST_PEER_IP not reachable over $RDMA_TEST_NETDEV after ${RXE_PEER_WAIT} tries"
    done
fi

ulimit -l unlimited || setup_failed "ulimit -l unlimited"
cd "$RXE_CWD" || setup_failed "cd $RXE_CWD"
echo "@@rxe-command-start@@"
"$@"
rc=$?
echo "@@rxe-command-end@@"
status "exit $rc"
