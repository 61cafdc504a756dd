# The device suite in the guest: the ignored tests of the test executables
# given as arguments whose names end in SUFFIX (all of them when SUFFIX is
# empty), each in a process of its own, each under a time limit.
#
#   sh device_suite.sh LIMIT_SECS SUFFIX EXECUTABLE...
#
# A test still running after LIMIT_SECS fails: its threads' stacks are
# printed (gdb), it is killed, and the suite goes on with the next one. The
# suite exits 1 if any test failed, after naming them. Tests that took a
# minute or more are named with their time (a hang in the making).
#
# `child_*` tests are halves their parents run in another process; alone
# they fail. `measure_*` tests print figures for docs/benchmarks.md and
# check nothing; they are run by hand. The suite leaves both out. A suite
# that selects no test at all fails.
limit=$1
suffix=$2
shift 2
failed=""
ran=0
for t in "$@"; do
    names=$("$t" --list --ignored | sed -n 's/: test$//p' | grep -v '^child_\|^measure_' | grep -- "$suffix\$")
    [ -n "$names" ] || continue
    echo "== $t"
    for name in $names; do
        ran=$((ran + 1))
        started=$(date +%s)
        "$t" --ignored --exact "$name" --test-threads=1 &
        pid=$!
        (
            sleep "$limit" </dev/null >/dev/null 2>&1
            kill -0 "$pid" 2>/dev/null || exit 0
            echo "xtask: $name still running after $limit s (hung?): its threads' stacks, then it is killed"
            gdb -p "$pid" -batch -ex 'thread apply all bt' 2>&1 | grep -v '^\[New LWP'
            kill -9 "$pid"
        ) &
        watchdog=$!
        wait "$pid" || failed="$failed $name"
        kill "$watchdog" 2>/dev/null
        wait "$watchdog" 2>/dev/null
        took=$(($(date +%s) - started))
        [ "$took" -lt 60 ] || echo "xtask: $name took $took s"
    done
done
if [ "$ran" = 0 ]; then
    echo "xtask: no device test's name ends in '$suffix'"
    exit 1
fi
if [ -n "$failed" ]; then
    echo "xtask: device tests failed:$failed"
    exit 1
fi
