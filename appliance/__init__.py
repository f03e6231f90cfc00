"""The observability-first LLM inference appliance."""


def version() -> str:
    """The installed distribution's version (the gateway's OpenAPI version, ``appliance --version``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("appliance")
    except PackageNotFoundError:
        return "0+unknown"
