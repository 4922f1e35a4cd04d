"""A small Python client for the public API.

    with Client("127.0.0.1:50051") as client:
        for message in client.generate("def fib(n):", max_tokens=32, temperature=0.0):
            print(message.text, end="")

    Client(address, api_key="...", tls_ca="ca.pem")   # a router with API keys and TLS

`generate` returns the gRPC call: iterate it for GenerateResponse messages, or
`.cancel()` it. Keyword arguments are engine.SamplingParams fields, and `cache_salt`
(requests with different salts never share cached prompt blocks). Importing this
module needs only grpcio and protobuf (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.keepalive import with_keepalive

_OPTIONS = pb.SamplingOptions.DESCRIPTOR.fields_by_name


def options_from_kwargs(**sampling: object) -> pb.SamplingOptions:
    """SamplingOptions from engine.SamplingParams-style keyword arguments (None: unset)."""
    options = pb.SamplingOptions()
    for name, value in sampling.items():
        field = _OPTIONS.get(name)
        if field is None:
            raise ValueError(f"{name}: not a sampling option (one of {sorted(_OPTIONS)})")
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name == "early_stopping" and isinstance(value, bool):
            value = str(value).lower()
        if field.is_repeated:
            getattr(options, name).extend(value)  # type: ignore[arg-type]
        else:
            setattr(options, name, value)
    return options


class Client:
    """`api_key`: sent as `authorization: Bearer <key>` on every call. `tls_ca`: a CA
    certificate file (PEM): the router is reached over TLS and must show a certificate
    that CA signed (`tls_server_name`: the name it carries, if not the host dialed)."""

    def __init__(self, address: str, timeout: float | None = 600.0, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls_server_name: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if tls_ca is None:
            self._channel = grpc.insecure_channel(address, options=with_keepalive([]))
        else:
            options = with_keepalive([("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else [])
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._stub = pb_grpc.GenerationStub(self._channel)

    def generate(
        self, prompt: str | Sequence[int], *, request_id: str = "", model: str = "", cache_salt: str = "",
        timeout: float | None = None, **sampling: object,
    ) -> grpc.Call:
        """Stream the completion; the call is an iterator of GenerateResponse."""
        request = pb.GenerateRequest(request_id=request_id, model=model, sampling=options_from_kwargs(**sampling),
                                     cache_salt=cache_salt)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata)

    def list_models(self, timeout: float = 10.0) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout, metadata=self._metadata).models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def collect(messages) -> dict[int, pb.GenerateResponse]:
    """Fold a stream into one message per sequence: all text and tokens, and the
    last message's finish reason, usage, timing."""
    out: dict[int, pb.GenerateResponse] = {}
    for m in messages:
        acc = out.setdefault(m.index, pb.GenerateResponse(request_id=m.request_id, index=m.index))
        acc.text += m.text
        acc.token_ids.extend(m.token_ids)
        acc.logprobs.extend(m.logprobs)
        if m.finish_reason:
            acc.finish_reason = m.finish_reason
            acc.usage.CopyFrom(m.usage)
            acc.timing.CopyFrom(m.timing)
            if m.HasField("cumulative_logprob"):
                acc.cumulative_logprob = m.cumulative_logprob
            acc.prompt_logprobs.extend(m.prompt_logprobs)
    return out
