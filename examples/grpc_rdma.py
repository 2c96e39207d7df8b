"""gRPC over RDMA with grpclib: a protobuf service served by RdmaServer, called through RdmaChannel.

The service, its messages and its stub are ordinary grpclib/protobuf code; only
the server class and the channel class come from aiodat.  ``--transport tcp``
runs the very same service with grpclib's own Server and Channel, which is how
the figures in docs/integrations.md were measured::

    aiodat rxe run -- python examples/grpc_rdma.py                # RDMA on the rxe device
    python examples/grpc_rdma.py --transport tcp                  # the same over TCP loopback
    python examples/grpc_rdma.py --calls 500 --repeats 3 --loop uvloop

The .proto (built here with protobuf's descriptor API, so the example needs no
protoc; with protoc you would import the generated ``greeter_pb2`` instead)::

    syntax = "proto3";
    package example;
    message HelloRequest { string name = 1; bytes blob = 2; }
    message HelloReply   { string message = 1; bytes blob = 2; }
    service Greeter {
      rpc SayHello (HelloRequest) returns (HelloReply);
      rpc Countdown (HelloRequest) returns (stream HelloReply);
    }
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any, Dict

import grpclib.client
import grpclib.const
import grpclib.server
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from aiodat.integrations.grpclib import RdmaChannel, RdmaServer


def build_messages() -> Any:
    """HelloRequest and HelloReply, as protoc's greeter_pb2 would define them."""
    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="greeter.proto", package="example", syntax="proto3")
    for name, text in (("HelloRequest", "name"), ("HelloReply", "message")):
        message = proto.message_type.add(name=name)
        message.field.add(name=text, number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        message.field.add(name="blob", number=2, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"example.{n}"))
                 for n in ("HelloRequest", "HelloReply"))


HelloRequest, HelloReply = build_messages()


class Greeter:
    """The service (what protoc-gen-grpclib's GreeterBase plus your methods amount to)."""

    async def SayHello(self, stream: grpclib.server.Stream) -> None:
        request = await stream.recv_message()
        assert request is not None  # (a unary call always carries its request)
        await stream.send_message(HelloReply(message=f"Hello, {request.name}!", blob=request.blob))

    async def Countdown(self, stream: grpclib.server.Stream) -> None:
        request = await stream.recv_message()
        assert request is not None
        for i in (3, 2, 1):
            await stream.send_message(HelloReply(message=f"{request.name} {i}"))

    def __mapping__(self) -> Dict[str, grpclib.const.Handler]:
        C = grpclib.const.Cardinality
        return {
            "/example.Greeter/SayHello": grpclib.const.Handler(self.SayHello, C.UNARY_UNARY, HelloRequest, HelloReply),
            "/example.Greeter/Countdown": grpclib.const.Handler(self.Countdown, C.UNARY_STREAM, HelloRequest,
                                                                HelloReply),
        }


class GreeterStub:
    """The client stub (what protoc-gen-grpclib generates)."""

    def __init__(self, channel: grpclib.client.Channel) -> None:
        self.SayHello = grpclib.client.UnaryUnaryMethod(channel, "/example.Greeter/SayHello",
                                                        HelloRequest, HelloReply)
        self.Countdown = grpclib.client.UnaryStreamMethod(channel, "/example.Greeter/Countdown",
                                                          HelloRequest, HelloReply)


async def main(transport: str, host: str, calls: int, repeats: int) -> None:
    if transport == "rdma":
        rdma_server = RdmaServer([Greeter()])                             # <- RDMA
        await rdma_server.start(host, 0)
        port = rdma_server.sockets[0].getsockname()[1]
        server: grpclib.server.Server = rdma_server
        channel: grpclib.client.Channel = RdmaChannel(host, port)         # <- RDMA
    else:
        server = grpclib.server.Server([Greeter()])
        await server.start(host, 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        channel = grpclib.client.Channel(host, port)
    label = "RDMA" if transport == "rdma" else "TCP"
    try:
        greeter = GreeterStub(channel)
        reply = await greeter.SayHello(HelloRequest(name="aiodat"))
        print(f"SayHello -> {reply.message!r} (gRPC over {label})")
        print("Countdown ->", [r.message for r in await greeter.Countdown(HelloRequest(name="liftoff"))])
        blob = os.urandom(1024 * 1024)
        reply = await greeter.SayHello(HelloRequest(name="big", blob=blob))
        if reply.blob != blob:
            raise SystemExit("the 1 MiB message came back different")
        print("1 MiB message verified")
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                await greeter.SayHello(HelloRequest(name="x"))
            rates.append(calls / (time.perf_counter() - start))
        print(f"{calls} unary calls one after the other over {label}: "
              f"median {statistics.median(rates):.0f} calls/s of {repeats} ({', '.join(f'{r:.0f}' for r in rates)})")
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    parser.add_argument("--host", default=None, help="default: 127.0.0.1 for tcp, $AIODAT_RXE_ADDR for rdma")
    parser.add_argument("--calls", type=int, default=200, help="unary calls per repeat")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args()
    host = args.host or ("127.0.0.1" if args.transport == "tcp" else os.environ.get("AIODAT_RXE_ADDR"))
    if host is None:
        parser.error("--host is needed for rdma (or run under `aiodat rxe run`, which sets AIODAT_RXE_ADDR)")
    coro = main(args.transport, host, args.calls, args.repeats)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
