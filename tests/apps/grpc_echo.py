"""A real protobuf gRPC service for the grpclib tests, without protoc.

The .proto below is built as a ``FileDescriptorProto`` and turned into message
classes by protobuf's own ``message_factory``: the classes are what protoc's
``*_pb2.py`` would give.  The service base and stub are what
``protoc-gen-grpclib`` generates (``__mapping__`` and ``*Method`` objects).

    syntax = "proto3";
    package aiodat.echo;
    message EchoRequest { string text = 1; bytes payload = 2; int32 count = 3; double seconds = 4;
                          int32 status = 5; }
    message EchoReply   { string text = 1; bytes payload = 2; int32 index = 3; }
    service Echo {
      rpc Unary (EchoRequest) returns (EchoReply);                   // echo; or sleep `seconds`; or fail with `status`
      rpc ServerStream (EchoRequest) returns (stream EchoReply);     // `count` replies of `payload`
      rpc ClientStream (stream EchoRequest) returns (EchoReply);     // the texts joined, payload bytes summed
      rpc Bidi (stream EchoRequest) returns (stream EchoReply);      // one reply per request, upper-cased
    }
"""
from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import grpclib.const
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpclib.client import Channel, StreamStreamMethod, StreamUnaryMethod, UnaryStreamMethod, UnaryUnaryMethod
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

PACKAGE = "aiodat.echo"
_F = descriptor_pb2.FieldDescriptorProto


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name="aiodat_echo.proto", package=PACKAGE, syntax="proto3")
    fields = {
        "EchoRequest": [("text", _F.TYPE_STRING), ("payload", _F.TYPE_BYTES), ("count", _F.TYPE_INT32),
                        ("seconds", _F.TYPE_DOUBLE), ("status", _F.TYPE_INT32)],
        "EchoReply": [("text", _F.TYPE_STRING), ("payload", _F.TYPE_BYTES), ("index", _F.TYPE_INT32)],
    }
    for name, members in fields.items():
        message = proto.message_type.add(name=name)
        for number, (field, kind) in enumerate(members, start=1):
            message.field.add(name=field, number=number, type=kind, label=_F.LABEL_OPTIONAL)
    service = proto.service.add(name="Echo")
    for method, client_streaming, server_streaming in [("Unary", False, False), ("ServerStream", False, True),
                                                        ("ClientStream", True, False), ("Bidi", True, True)]:
        service.method.add(name=method, input_type=f".{PACKAGE}.EchoRequest", output_type=f".{PACKAGE}.EchoReply",
                           client_streaming=client_streaming, server_streaming=server_streaming)
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
EchoRequest: Any = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.EchoRequest"))
EchoReply: Any = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.EchoReply"))

_C = grpclib.const.Cardinality


class EchoBase:
    """The service as protoc-gen-grpclib would generate its base class: methods mapped by path."""

    async def Unary(self, stream: Stream) -> None:
        raise NotImplementedError

    async def ServerStream(self, stream: Stream) -> None:
        raise NotImplementedError

    async def ClientStream(self, stream: Stream) -> None:
        raise NotImplementedError

    async def Bidi(self, stream: Stream) -> None:
        raise NotImplementedError

    def __mapping__(self) -> Dict[str, grpclib.const.Handler]:
        return {
            f"/{PACKAGE}.Echo/Unary": grpclib.const.Handler(self.Unary, _C.UNARY_UNARY, EchoRequest, EchoReply),
            f"/{PACKAGE}.Echo/ServerStream": grpclib.const.Handler(self.ServerStream, _C.UNARY_STREAM,
                                                                   EchoRequest, EchoReply),
            f"/{PACKAGE}.Echo/ClientStream": grpclib.const.Handler(self.ClientStream, _C.STREAM_UNARY,
                                                                   EchoRequest, EchoReply),
            f"/{PACKAGE}.Echo/Bidi": grpclib.const.Handler(self.Bidi, _C.STREAM_STREAM, EchoRequest, EchoReply),
        }


class EchoStub:
    """The client stub, as protoc-gen-grpclib would generate it."""

    def __init__(self, channel: Channel) -> None:
        self.Unary = UnaryUnaryMethod(channel, f"/{PACKAGE}.Echo/Unary", EchoRequest, EchoReply)
        self.ServerStream = UnaryStreamMethod(channel, f"/{PACKAGE}.Echo/ServerStream", EchoRequest, EchoReply)
        self.ClientStream = StreamUnaryMethod(channel, f"/{PACKAGE}.Echo/ClientStream", EchoRequest, EchoReply)
        self.Bidi = StreamStreamMethod(channel, f"/{PACKAGE}.Echo/Bidi", EchoRequest, EchoReply)


class EchoService(EchoBase):
    """The implementation the tests call; records what happened to handlers for the cancellation tests."""

    def __init__(self) -> None:
        self.cancelled: "asyncio.Queue[str]" = asyncio.Queue()  # names of handlers that saw CancelledError
        self.peers: List[Any] = []

    async def Unary(self, stream: Stream) -> None:
        request = await stream.recv_message()
        assert request is not None
        self.peers.append(stream.peer.addr())
        if request.status:
            raise GRPCError(grpclib.const.Status(request.status), f"asked to fail: {request.text}")
        if request.seconds:
            try:
                await asyncio.sleep(request.seconds)
            except asyncio.CancelledError:
                self.cancelled.put_nowait("Unary")
                raise
        await stream.send_message(EchoReply(text=request.text, payload=request.payload))

    async def ServerStream(self, stream: Stream) -> None:
        request = await stream.recv_message()
        assert request is not None
        try:
            for index in range(request.count):
                await stream.send_message(EchoReply(text=request.text, payload=request.payload, index=index))
                if request.seconds:
                    await asyncio.sleep(request.seconds)
        except asyncio.CancelledError:
            self.cancelled.put_nowait("ServerStream")
            raise

    async def ClientStream(self, stream: Stream) -> None:
        texts, total = [], 0
        async for request in stream:
            texts.append(request.text)
            total += len(request.payload)
        await stream.send_message(EchoReply(text=",".join(texts), index=total))

    async def Bidi(self, stream: Stream) -> None:
        index = 0
        async for request in stream:
            await stream.send_message(EchoReply(text=request.text.upper(), payload=request.payload, index=index))
            index += 1
