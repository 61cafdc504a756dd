#!/bin/busybox sh
# PID 1 of the Soft-RoCE test guest (`cargo xtask rxe`), baked into the
# initramfs. It loads the modules listed in /modules/order, mounts the host's
# root read-only (9p) under a tmpfs-backed overlay, mounts the run's
# read-write share at /rxe-run, and chroots into the host's userspace to run
# /rxe-run/job.sh, which sets up the RDMA device and runs the command.
# Whatever happens, the guest powers off at the end: qemu then exits.
/bin/busybox --install -s /bin
export PATH=/bin

setup_failed() {
    echo "rxe-guest: set-up failed: $*"
    [ -d /mnt/run ] && echo "setup-failed $*" > /mnt/run/status
    poweroff -f
}

mkdir -p /proc /sys /dev /mnt/host /mnt/rw /mnt/root /mnt/run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

while read -r module args; do
    insmod "/modules/$module" $args || setup_failed "insmod $module $args"
done < /modules/order

mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none rxerun /mnt/run \
    || setup_failed "mounting the run share (9p tag rxerun)"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /mnt/host \
    || setup_failed "mounting the host's root (9p tag hostroot)"
mount -t tmpfs -o mode=0755 tmpfs /mnt/rw || setup_failed "mounting the tmpfs upper layer"
mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay overlay -o lowerdir=/mnt/host,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work /mnt/root \
    || setup_failed "mounting the overlay on the host's root"

R=/mnt/root
mkdir -p $R/proc $R/sys $R/dev $R/run $R/rxe-run
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts $R/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
mount -t tmpfs -o mode=0755 tmpfs $R/run
mount -t configfs configfs $R/sys/kernel/config 2>/dev/null
mount --bind /mnt/run $R/rxe-run || setup_failed "bind-mounting the run share"

chroot $R /bin/sh /rxe-run/job.sh < /dev/null
sync
poweroff -f
