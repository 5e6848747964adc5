"""The buffer server's registration with its wire views: PutGroups, GetBatch and TakeBatch carry sample groups as
the bytes Redis stores, so no group's token lists are turned into Python objects or serialized again on the way.

buffer.proto's Encoded* views share the wire encoding of the messages clients send and receive; only the (de)coders
of those three methods change, the servicer and its clients stay as generated.
"""

from __future__ import annotations

import grpc

from services.common.gen.physarum.v1 import buffer_pb2, buffer_pb2_grpc
from services.common.samples import EncodedGroup, encoded_group_from_payload

SERVICE = "physarum.v1.Buffer"


def decode_put_groups(data: bytes) -> list[EncodedGroup]:
    """A PutGroupsRequest's groups, kept as the bytes they came in, indexed by the headers their writer sent (the
    store checks each group's bytes start with its group_id); without headers each group is parsed once."""
    request = buffer_pb2.EncodedPutGroupsRequest.FromString(data)
    if not request.headers:
        return [encoded_group_from_payload(group) for group in request.groups]
    if len(request.headers) != len(request.groups):
        raise ValueError(f"{len(request.headers)} headers for {len(request.groups)} groups")
    return [EncodedGroup(h.group_id, h.job_id, h.rollout_id, h.prompt_index, h.epoch, h.lease_id,
                         (h.oldest_weight_version, h.newest_weight_version), payload, h.num_tokens)
            for h, payload in zip(request.headers, request.groups, strict=True)]


_VIEWS = {  # method -> (request decoder, reply encoder); None keeps the generated one
    "PutGroups": (decode_put_groups, None),
    "GetBatch": (None, buffer_pb2.EncodedGroupsResponse.SerializeToString),
    "TakeBatch": (None, buffer_pb2.EncodedGroupsResponse.SerializeToString),
}


class _Handlers:
    """Stands in for the server while the generated function registers the servicer, to keep its handler table."""

    def __init__(self) -> None:
        self.table: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same table also comes to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, table: dict[str, grpc.RpcMethodHandler]) -> None:
        self.table.update(table)


def add_buffer_servicer(servicer: buffer_pb2_grpc.BufferServicer, server: grpc.aio.Server) -> None:
    """buffer_pb2_grpc.add_BufferServicer_to_server, with the wire views' (de)coders in place of the generated ones."""
    handlers = _Handlers()
    buffer_pb2_grpc.add_BufferServicer_to_server(servicer, handlers)
    table = dict(handlers.table)
    if missing := set(_VIEWS) - table.keys():
        raise RuntimeError(f"buffer_pb2_grpc registered no handler for {sorted(missing)}: regenerate the stubs "
                           "(make proto) with the grpcio-tools version in pyproject.toml")
    for method, (decode, encode) in _VIEWS.items():
        handler = table[method]
        table[method] = handler._replace(request_deserializer=decode or handler.request_deserializer,
                                         response_serializer=encode or handler.response_serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, table),))
    server.add_registered_method_handlers(SERVICE, table)
