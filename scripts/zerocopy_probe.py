"""Does MSG_ZEROCOPY save the send copy on this path? A TCP sender that sends with
MSG_ZEROCOPY gets one completion per send on its error queue; the kernel sets
SO_EE_CODE_ZEROCOPY_COPIED on it when it had to copy the pages after all, which it does for
every skb delivered to a local socket (loopback, veth between network namespaces: the emulated
cluster of scripts/cluster.sh). There zerocopy only adds the page pinning and the completions.

Usage (root for `veth`):
  python3 scripts/zerocopy_probe.py veth [MB] [CHUNK_KB]    two network namespaces joined by
                                                           a veth pair (MTU 9000), as
                                                           cluster.sh's hosts, and the two
                                                           ends below between them
  python3 scripts/zerocopy_probe.py server PORT            the sink: reads and discards
  python3 scripts/zerocopy_probe.py client HOST PORT MB CHUNK_KB
                                                           sends MB MiB in CHUNK_KB sends,
                                                           first plainly, then with
                                                           MSG_ZEROCOPY, and prints the wall
                                                           and CPU time of each and how many
                                                           completions came back COPIED
"""
import os
import resource
import socket
import struct
import subprocess
import sys
import time

SO_ZEROCOPY = 60
MSG_ZEROCOPY = 0x4000000
SO_EE_ORIGIN_ZEROCOPY = 5
SO_EE_CODE_ZEROCOPY_COPIED = 1


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def server(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(1)
    buf = bytearray(1 << 20)
    for _ in range(2):
        s, _ = ls.accept()
        n, c0 = 0, cpu()
        while k := s.recv_into(buf):
            n += k
        print(f"server: {n >> 20} MiB received, cpu {cpu() - c0:.3f} s", flush=True)
        s.close()


class Completions:
    """Zerocopy completions read off a socket's error queue."""

    def __init__(self, s):
        self.s, self.done, self.copied = s, 0, 0

    def drain(self, block):
        while True:
            flags = socket.MSG_ERRQUEUE | (0 if block else socket.MSG_DONTWAIT)
            try:
                _, anc, _, _ = self.s.recvmsg(0, 1024, flags)
            except BlockingIOError:
                return
            for _, _, d in anc:
                # struct sock_extended_err: errno, origin, type, code, pad, info (lo), data (hi)
                _errno, origin, _type, code, _pad, lo, hi = struct.unpack("=IBBBBII", d[:16])
                if origin == SO_EE_ORIGIN_ZEROCOPY:
                    self.done += hi - lo + 1
                    if code & SO_EE_CODE_ZEROCOPY_COPIED:
                        self.copied += hi - lo + 1
            if block:
                return


def client(host, port, mb, chunk):
    data = memoryview(bytearray(os.urandom(1 << 20)) * 4)
    for zc in (False, True):
        s = socket.create_connection((host, port))
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        comp = Completions(s)
        sent, calls, c0, t0 = 0, 0, cpu(), time.perf_counter()
        while sent < mb << 20:
            off = sent % len(data)
            n = min(chunk, len(data) - off)
            sent += s.send(data[off : off + n], MSG_ZEROCOPY if zc else 0)
            calls += 1
            if zc:
                comp.drain(False)
        while zc and comp.done < calls:
            comp.drain(True)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        s.close()
        line = (f"client MSG_ZEROCOPY={int(zc)}: {sent >> 20} MiB in {calls} sends, "
                f"{time.perf_counter() - t0:.2f} s, cpu {cpu() - c0:.3f} s")
        if zc:
            line += f", completions {comp.done}, flagged COPIED {comp.copied}"
        print(line, flush=True)


def veth(mb, chunk_kb):
    a, b = f"zcprobe{os.getpid()}a", f"zcprobe{os.getpid()}b"
    sh = lambda *c: subprocess.run(c, check=True)
    sh("ip", "netns", "add", a)
    try:
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", "eth0", "netns", a, "mtu", "9000", "type", "veth", "peer",
           "name", "eth0", "netns", b, "mtu", "9000")
        for ns, ip in ((a, "10.78.0.1"), (b, "10.78.0.2")):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        me = os.path.abspath(__file__)
        srv = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, me, "server", "29700"])
        time.sleep(1)
        subprocess.run(["ip", "netns", "exec", b, "timeout", "300", sys.executable, me,
                        "client", "10.78.0.1", "29700", str(mb), str(chunk_kb)], check=True)
        srv.wait(timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", b], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "netns", "del", a], stderr=subprocess.DEVNULL)


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "server":
        server(int(sys.argv[2]))
    elif cmd == "client":
        client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]) << 10)
    elif cmd == "veth":
        veth(int(sys.argv[2]) if len(sys.argv) > 2 else 2048,
             int(sys.argv[3]) if len(sys.argv) > 3 else 256)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
