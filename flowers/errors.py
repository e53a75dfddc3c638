"""Errors meant for the user: the CLI prints their message as one paragraph, with no traceback."""


class FlowersError(Exception):
    pass


class DataError(FlowersError):
    pass


class ConfigError(FlowersError):
    pass
