"""Errors meant for the user: the CLI prints their message as one paragraph, with no traceback."""

from __future__ import annotations

import torch.distributed as dist


class FlowersError(Exception):
    pass


class DataError(FlowersError):
    pass


class ConfigError(FlowersError):
    pass


class CheckpointWriteError(FlowersError):
    """A checkpoint could not be written (disk full, quota, file size limit); the old one is kept."""


# What gloo and NCCL say when a peer process is gone or stopped answering.
PEER_FAILURE_SIGNS = ("connection closed by peer", "connection reset by peer", "timed out", "timeout",
                      "broken pipe", "nccl communicator was aborted", "socket closed")


class PeerError(FlowersError):
    """Another ddp process died or hung, and this one gave up waiting for it."""

    @classmethod
    def from_distributed(cls, error: BaseException) -> PeerError | None:
        """The user-facing form of a collective that failed because of a peer, or None for other errors."""
        text = str(error)
        is_distributed = isinstance(error, dist.DistError) or "gloo" in text.lower() or "nccl" in text.lower()
        if not (is_distributed and any(sign in text.lower() for sign in PEER_FAILURE_SIGNS)):
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
        return cls(
            f"rank {rank} lost contact with another ddp process ({first_line}). A peer died (killed, out of "
            "memory, crashed: see its own log) or stopped answering for --ddp_timeout seconds. The last "
            "checkpoint is intact: fix the cause and resume with --ckpt_path last."
        )
