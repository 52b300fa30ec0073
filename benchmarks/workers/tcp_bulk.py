"""TCP bulk transfer for goodput measurement inside an emulated host.

    python -m benchmarks.workers.tcp_bulk recv --bind ADDR --port P
        accepts one connection, counts payload bytes until EOF, prints
        {"bytes": ..., "seconds": ..., "bps": ...} (timed from the first byte).
    python -m benchmarks.workers.tcp_bulk send --to ADDR --port P --seconds S
        sends zeros for S seconds.
"""

import argparse
import json
import socket
import time

BLOCK = 1 << 20


def recv(bind: str, port: int) -> None:
    with socket.create_server((bind, port)) as server:
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(BLOCK)
            total = 0
            n = conn.recv_into(buf)
            start = time.perf_counter()
            while n:
                total += n
                n = conn.recv_into(buf)
            seconds = time.perf_counter() - start
    print(json.dumps({"bytes": total, "seconds": seconds, "bps": 8 * total / seconds}))


def send(to: str, port: int, seconds: float) -> None:
    payload = bytes(BLOCK)
    for attempt in range(50):   # the receiver may still be binding
        try:
            conn = socket.create_connection((to, port), timeout=10)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"tcp_bulk: cannot connect to {to}:{port}")
    with conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(payload)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["recv", "send"])
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--to")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    if args.mode == "recv":
        recv(args.bind, args.port)
    else:
        send(args.to, args.port, args.seconds)


if __name__ == "__main__":
    main()
