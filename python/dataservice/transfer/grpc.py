"""The gRPC transfer protocol: `WorkerService.GetElements` on the worker's port."""

from __future__ import annotations

from typing import Any

import grpc

from dataservice import auth, errors
from dataservice.rpc import service_pb2, service_pb2_grpc
from dataservice.rpc import util as rpc_util
from dataservice.transfer import base, codec


class GrpcTransferClient(base.TransferClient):
    """Fetches a task's elements over gRPC; one caller thread at a time."""

    protocol = "grpc"

    def __init__(
        self,
        endpoint: base.TaskEndpoint,
        auth_token: str | None,
        compression: str = "",
        zero_copy: bool = True,  # elements over gRPC are always copies
        trainer_id: str = "",  # each request names its own trainer id
    ) -> None:
        self._endpoint = endpoint
        self._compression = compression  # "" or "zstd", chosen by the reader
        self._channel = rpc_util.make_channel(endpoint.transfer_address)
        self._stub = service_pb2_grpc.WorkerServiceStub(self._channel)
        token = rpc_util.token_from_env(auth_token)
        auth.warn_if_sent_in_clear(endpoint.transfer_address, token)
        self._metadata = rpc_util.call_metadata(token)
        self._error: errors.WorkerError | None = None  # the pipeline's, once reported

    def get_elements(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int = -1,
        round_index: int = -1,
        trainer_id: str = "",
    ) -> base.ElementsResult:
        request = service_pb2.GetElementsRequest(
            task_id=self._endpoint.task_id,
            max_elements=max_elements,
            max_bytes=max_bytes,
            consumer_index=consumer_index,
            round_index=round_index,
            trainer_id=trainer_id,
            compression=self._compression,
        )
        if self._error is not None:  # after the elements that came with it
            raise self._error
        try:
            response = self._stub.GetElements(
                request, timeout=timeout_s + 5.0, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise rpc_util.to_error(err, self._endpoint.transfer_address, "GetElements") from None
        elements: list[Any] = [codec.decode(e) for e in response.elements]
        nbytes = sum(len(e) for e in response.elements)
        if response.error_type:
            self._error = errors.RemoteErrorInfo(
                response.error_type,
                response.error_message,
                response.error_traceback,
                response.error_pickle,
            ).to_exception(self._endpoint.worker_address)
            if not elements:
                raise self._error
            # The elements produced before the failure come first, as over shm.
            return base.ElementsResult(elements, nbytes, False, response.worker_uid)
        return base.ElementsResult(elements, nbytes, response.end_of_sequence, response.worker_uid)

    def set_compression(self, compression: str) -> None:
        self._compression = compression

    def close(self) -> None:
        self._channel.close()


base.register_protocol("grpc", GrpcTransferClient)
