"""PID 1 of one harness host (run by ``hosts.Host``, never by hand).

Started as ``nsenter --net=/run/netns/<ns> unshare --uts --mount --pid --fork --propagation private
--mount-proc python hostinit.py NAME HOSTS_FILE``, so it already has the host's network
namespace, its own UTS, mount and PID namespaces and a ``/proc`` of its own. It then

1. mounts a private tmpfs on ``/dev/shm`` (the host's memory tier: it goes with the mount
   namespace, i.e. when the last process of the host is gone),
2. bind-mounts the run's shared hosts file on ``/etc/hosts`` (every host resolves every other
   host's name, as DNS would on a cluster),
3. binds a sysfs of its own network namespace over ``/sys/class/net`` and ``/sys/devices/virtual/net``
   (the rest of ``/sys`` stays the machine's, its cgroup mounts included, which ``slurmd`` wants):
   inherited by ``nsenter --net``, those directories would list the *machine's* interfaces, and a
   launcher's nic health check would watch the machine's ``eth0`` instead of the host's,
4. sets the hostname, prints ``ready`` and reaps: processes started on the host with
   ``nsenter`` are reparented to it when their parent dies, and it waits for them.

SIGKILL to it (from the machine's PID namespace) kills every process of the host at once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def main() -> None:
    name, hosts_file, shm_size = sys.argv[1], sys.argv[2], sys.argv[3]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777", "tmpfs", "/dev/shm"], check=True)
    subprocess.run(["mount", "--bind", hosts_file, "/etc/hosts"], check=True)
    own_net_sysfs()
    socket.sethostname(name)
    print("ready", flush=True)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.2)


def own_net_sysfs() -> None:
    """This network namespace's interfaces in ``/sys/class/net`` (its entries are links into
    ``/sys/devices/virtual/net``, a host's veths being virtual): a sysfs lists the interfaces of the
    namespace that mounted it, so one is mounted here, on a scratch directory of the host's own
    ``/dev/shm``, its two net directories bound over the machine's, and the scratch mount removed."""
    scratch = "/dev/shm/.hostinit-sysfs"
    os.mkdir(scratch)
    subprocess.run(["mount", "-t", "sysfs", "sysfs", scratch], check=True)
    try:
        for sub in ("class/net", "devices/virtual/net"):
            subprocess.run(["mount", "--bind", f"{scratch}/{sub}", f"/sys/{sub}"], check=True)
    finally:
        subprocess.run(["umount", scratch], check=True)
        os.rmdir(scratch)


if __name__ == "__main__":
    main()
