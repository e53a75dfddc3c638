"""Errors meant for the user: the CLI prints their message as one paragraph, with no traceback."""

from __future__ import annotations

import argparse


class FlowersError(Exception):
    pass


class DataError(FlowersError):
    pass


class ConfigError(FlowersError):
    pass


class CheckpointWriteError(FlowersError):
    """A checkpoint could not be written (disk full, quota, file size limit); the old one is kept."""


class PeerError(FlowersError):
    """Another ddp process died or hung, and this one gave up waiting for it."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the house error: one paragraph, ``<prog>: error: …`` and where the options are listed;
    the usage is for ``--help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}. `{self.prog} --help` lists the options.\n")
