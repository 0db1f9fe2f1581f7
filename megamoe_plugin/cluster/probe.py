"""A TCP bandwidth probe between two emulated nodes (or within one), run by the launcher before the job starts.

Run as a file (``python probe.py serve ADDR PORT`` / ``python probe.py send ADDR PORT NBYTES``), not as a module
of the package, so that it starts in milliseconds (no torch import). The server prints ``ready`` once listening,
then ``<bytes> <seconds>`` measured from the first to the last byte received.
"""
import socket
import sys
import time

CHUNK = 1 << 16


def serve(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(1)
        s.settimeout(30)
        print("ready", flush=True)
        conn, _ = s.accept()
        with conn:
            conn.settimeout(60)
            first = conn.recv(CHUNK)
            t0, total = time.perf_counter(), len(first)
            while True:
                data = conn.recv(CHUNK)
                if not data:
                    break
                total += len(data)
            dt = time.perf_counter() - t0
    print(f"{total} {dt:.6f}", flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    payload = b"\0" * CHUNK
    with socket.create_connection((addr, port), timeout=30) as s:
        sent = 0
        while sent < nbytes:
            s.sendall(payload[: min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
