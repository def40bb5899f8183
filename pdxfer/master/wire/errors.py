"""Errors a master call ends in (all are MasterError): the client raises them, as does TLS set-up."""

from __future__ import annotations


class MasterError(RuntimeError):
    """Base of every error the client raises."""


class MasterUnavailable(MasterError):
    """No master answered within the time budget (refused, reset, timed out, no leader)."""


class NotLeader(MasterUnavailable):
    """The master answered "not leader": a standby, or a leader whose lease may have run out (it
    stops serving before a standby can take over). A lock it granted must be treated as lost."""


class MasterProtocolError(MasterError):
    """The master refused a message as malformed, oversized or of another version (or vice versa)."""


class MasterAuthError(MasterError):
    """The master refused the token."""


class RegistrationSuperseded(MasterError):
    """The node id was registered again (by another process, or this one) after the registration
    this call names: the caller must stop serving as that node, not re-register over the newer one."""


class PublishFenced(MasterError):
    """The publish's sequence number is at or below the node's fence (the holder gave up on it):
    nothing of it was applied."""


class UnknownNode(MasterError):
    """The master does not know this node (never registered, deregistered, or its lease expired)."""
