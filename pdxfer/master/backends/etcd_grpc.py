"""An ``aetcd`` client that can speak TLS and authenticate, for the replicas' coordinator.

aetcd opens only plain channels; this client opens the channel itself (TLS with our CA and client
certificate when the settings ask for it), proves it can talk to etcd before the coordinator
uses it (authenticating as the configured user, or asking for the member's status), and turns a
refusal into an ``EtcdRefused`` that names the setting etcd or the handshake did not accept.
"""

from __future__ import annotations

import grpc
import grpc.aio
from aetcd import Client, rpc, watcher

from pdxfer.master.backends.etcd_security import EtcdRefused, EtcdSecurity, explain_auth_error, explain_tls_error


class SecureEtcdClient(Client):
    def __init__(self, host: str, port: int, security: EtcdSecurity, timeout_s: float) -> None:
        # No username/password for aetcd: it would authenticate over its own plain channel.
        super().__init__(host=host, port=port, timeout=timeout_s)
        self.security = security
        self.where = f"{host}:{port}"

    def _open_channel(self) -> grpc.aio.Channel:
        target = self.where
        if not self.security.tls:
            return grpc.aio.insecure_channel(target)
        try:
            ca, key, chain = self.security.read_pem()
        except OSError as exc:
            raise EtcdRefused(f"cannot read an etcd TLS file: {exc}") from None
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
        return grpc.aio.secure_channel(target, creds)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        channel = self._open_channel()
        try:
            metadata = await self._prove(channel)
        except BaseException:
            await channel.close()
            raise
        self.channel, self.metadata = channel, metadata
        self.kvstub = rpc.KVStub(channel)
        self.clusterstub = rpc.ClusterStub(channel)
        self.leasestub = rpc.LeaseStub(channel)
        self.maintenancestub = rpc.MaintenanceStub(channel)
        self.auth_stub = rpc.AuthStub(channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata)
        self._connected.set()

    async def _prove(self, channel: grpc.aio.Channel) -> tuple[tuple[str, str], ...] | None:
        """One round trip that fails the way later calls would: the auth token's metadata, if any."""
        sec = self.security
        try:
            if sec.user:
                reply = await rpc.AuthStub(channel).Authenticate(
                    rpc.AuthenticateRequest(name=sec.user, password=sec.read_password()), timeout=self._timeout)
                return (("token", reply.token),)
            await rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=self._timeout)
            return None
        except grpc.aio.AioRpcError as exc:
            detail = exc.details() or ""
            why = explain_tls_error(self.where, detail, sec) or explain_auth_error(self.where, detail, sec)
            if why is not None:
                raise EtcdRefused(why) from None
            raise ConnectionError(f"{self.where}: {exc.code().name}: {detail}") from None


def explain_rpc_error(where: str, exc: BaseException, sec: EtcdSecurity) -> str | None:
    """A refusal (permission, auth) behind a failed call after connecting, else None."""
    detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    return explain_auth_error(where, detail or "", sec)
