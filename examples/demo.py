"""The demo: start examples/echo_server.py, run examples/echo_client.py against it, exit 0 if every echo checked out.

    aiodat rxe run -- python examples/demo.py [--count 10] [--size 64] [--port PORT]

Server and client are two processes on the same RDMA device and address (on
Soft-RoCE they share the rxe device, as two hosts would share a fabric).
"""
import argparse
import os
import random
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=random.randint(7000, 7999))
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--size", type=int, default=64, help="bytes per message (1..4096)")
    args = parser.parse_args()
    if not 1 <= args.size <= 4096:  # (else the client refuses only after the server is up, which then waits)
        parser.error(f"--size {args.size}: must be 1 to 4096 (the echo server's receive buffer)")
    if args.count < 1:
        parser.error(f"--count {args.count}: must be at least 1")
    server = subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "echo_server.py"), "--port", str(args.port),
                               "--clients", "1"], stdout=subprocess.PIPE, text=True)
    out = server.stdout
    assert out is not None  # (stdout=PIPE)
    first = out.readline()  # "server: listening on ADDR:PORT" once the PSP is up
    print(first, end="", flush=True)
    if "listening" not in first:
        server.kill()
        print("demo: the echo server did not start", file=sys.stderr)
        return 1
    relay = threading.Thread(target=lambda: [print(line, end="", flush=True) for line in out])
    relay.start()
    client = subprocess.run([sys.executable, os.path.join(HERE, "echo_client.py"), "--port", str(args.port),
                             "--count", str(args.count), "--size", str(args.size)], timeout=120)
    try:
        server_rc = server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server_rc = -1
    relay.join()
    out.close()
    ok = client.returncode == 0 and server_rc == 0
    print(f"demo: {'ok' if ok else 'FAILED'} (client exit {client.returncode}, server exit {server_rc})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
