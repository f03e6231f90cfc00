"""The engine sections of the settings (``engine.*``, ``discovery.*``): owned here, beside the code that builds
engine command lines and finds engines, and composed into :class:`appliance.settings.Settings`."""

from __future__ import annotations

import json
import shlex
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from appliance.engine.identity import EngineUser
from appliance.model.shape import KvCacheDtype
from appliance.setting_types import CommaList, blank_is_unset


class EngineSettings(BaseModel):
    """The engine replicas this appliance runs: where they listen and log, how crashes are retried, and vLLM's own
    settings, named as vLLM names its flags (``max_model_len`` is ``--max-model-len``). The first eight keys were
    top-level ``engine_*`` and ``restart_backoff_*`` keys before this section: those names keep working in YAML and
    as ``APPLIANCE_<KEY>`` (appliance.settings.FLAT_ALIASES)."""

    model_config = ConfigDict(extra="forbid")

    base_port: int = Field(8100, ge=1, le=65000, description="Replica i listens on this port + i.")
    host: str = Field(
        "127.0.0.1", description="Engines' bind address. Keep loopback unless Prometheus scrapes them from another "
        "network namespace (compose: the appliance's alias on an internal network only Prometheus shares)."
    )
    advertise_host: str | None = Field(
        None, description="Host name /sd/targets gives Prometheus for the engines; default engine.host "
        "(compose: the appliance service's name)."
    )
    log_max_bytes: int = Field(
        50_000_000, ge=1024, description="Each engine's log (state_dir/logs/engine-N.log) rotates at this size."
    )
    log_backups: int = Field(
        3, ge=1, description="Rotated engine logs kept (engine-N.log.1 ...); at least one, or nothing rotates."
    )
    log_stdout: bool = Field(
        False, description="Engine output also on the appliance's stdout, each line prefixed [replica-N] "
        "(compose and the image: true, so that `docker logs` shows it)."
    )
    user: str | None = Field(
        None, description="Run the engines as this user (a name or a uid; its own group, no other): vLLM, its plugins "
        "and model code then cannot read the appliance's secret files or its memory. Needs an appliance run as "
        "root or with CAP_SETUID, CAP_SETGID and CAP_KILL (the image's entrypoint); unset: the appliance's own user."
    )
    restart_backoff_initial_seconds: float = Field(1.0, gt=0, description="First wait before restarting a crash.")
    restart_backoff_max_seconds: float = Field(60.0, gt=0, description="Cap of the doubling restart backoff.")
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + completion, in tokens. Unset: the model's own limit from its "
        "config.json, as vLLM derives it (1024 with no model: the demo model's)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences batched together per step (continuous batching).")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget per scheduler step; vLLM's default when unset."
    )
    block_size: int | None = Field(None, ge=1, description="Paged KV-cache block size in tokens.")
    kv_cache_space_gib: int = Field(
        1, ge=1, description="CPU hosts: KV-cache space per replica in whole GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU hosts: fraction of device memory vLLM may use (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica.")
    dtype: str = Field("auto", description="Activation dtype (vLLM --dtype).")
    quantization: str | None = Field(
        None, description="vLLM --quantization; unset lets vLLM read it from the checkpoint (compressed-tensors)."
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto", description="vLLM --kv-cache-dtype: auto keeps K/V in the model's dtype; fp8 (= fp8_e4m3) and "
        "fp8_e5m2 halve the KV cache's bytes per token, so the same space holds twice the tokens. Without "
        "k/v scales in the checkpoint vLLM uses scale 1.0."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM --scheduling-policy. priority: each engine runs its waiting requests in the order "
        "the gateway gives them (the tenant's priority, then whether it is over its fair share; "
        "docs/tenants.md), not only in arrival order; fcfs: arrival order (vLLM's default)."
    )
    kv_events: Literal["off", "local", "network"] = Field(
        "off", description="KV-cache events (vLLM --kv-events-config) for the gateway's precise prefix routing "
        "(routing.prefix_cache.mode): each replica publishes the blocks its prefix cache stores and evicts. local: "
        "bound on 127.0.0.1, for this host's gateway; network: bound on every interface, for gateways on other "
        "hosts (role node; the events carry the prompts' token ids: keep them on a network only the gateways "
        "share). Also pins the block hash (sha256, PYTHONHASHSEED=random) so that the gateway computes the same."
    )
    kv_events_port_offset: int = Field(
        1000, ge=1, le=30000, description="Replica i publishes its KV events on its port (base_port + i) plus this."
    )
    kv_events_replay_port_offset: int = Field(
        2000, ge=1, le=30000, description="...and answers replay requests (the batches a gateway missed) on its "
        "port plus this."
    )
    shutdown_timeout_seconds: int = Field(
        10, ge=0, description="vLLM --shutdown-timeout: how long an engine finishes requests on SIGTERM."
    )
    start_timeout_seconds: float = Field(
        300, gt=0, description="How long a starting engine may take to answer /health before it counts as failed."
    )
    start_silence_timeout_seconds: float = Field(
        120, ge=0, description="A starting engine that has not written one line of output this long after its "
        "start hangs before vLLM even began (vLLM prints its banner within seconds, before the model loads): it "
        "is ended and started again, with its processes' states and Python stacks in its log. 0 turns the check off."
    )
    health_timeout_seconds: float = Field(
        2.0, gt=0, description="How long one /health probe of a running engine may take; 3 failed probes in a "
        "row (2 s apart) take it out of routing. A late probe does not count while the gateway receives the "
        "engine's response bytes (busy, not hung). Raise it where engines share starved CPUs."
    )
    extra_args: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="More vLLM flags, passed verbatim. In the environment one string split "
        "like a shell command line (APPLIANCE_ENGINE__EXTRA_ARGS='--enforce-eager --seed 1'), or a JSON list."
    )

    @field_validator("user", mode="before")
    @classmethod
    def _blank_user_is_unset(cls, value: Any) -> Any:
        return blank_is_unset(value)

    @field_validator("user")
    @classmethod
    def _an_unprivileged_user(cls, value: str | None) -> str | None:
        """A user that exists here, and not root: root would hold every secret again."""
        if value is None:
            return value
        try:
            user = EngineUser.lookup(value)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
        if user.uid == 0:
            raise ValueError(f"engine.user {value!r} is root: name an unprivileged user of the engines' own")
        return value

    @field_validator("extra_args", mode="before")
    @classmethod
    def _split_args(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else shlex.split(text)
        return value

    @field_validator("extra_args")
    @classmethod
    def _no_owned_flags_in_extra_args(cls, value: list[str]) -> list[str]:
        for flag, setting in (("--kv-cache-dtype", "kv_cache_dtype"), ("--scheduling-policy", "scheduling_policy")):
            if any(arg.split("=", 1)[0] == flag for arg in value):
                raise ValueError(f"set engine.{setting} instead of passing {flag} in extra_args")
        return value


    @model_validator(mode="after")
    def _kv_events_own_their_flags(self) -> EngineSettings:
        """With KV events on, the gateway must compute the engines' block hashes: the flags that decide them are
        set here, not in extra_args; and the two sockets need two ports."""
        if self.kv_events == "off":
            return self
        if self.kv_events_port_offset == self.kv_events_replay_port_offset:
            raise ValueError("kv_events_port_offset and kv_events_replay_port_offset must differ")
        for flag in ("--kv-events-config", "--prefix-caching-hash-algo"):
            if any(arg.split("=", 1)[0] == flag for arg in self.extra_args):
                raise ValueError(f"engine.kv_events sets {flag}: remove it from extra_args")
        return self


class DiscoverySettings(BaseModel):
    """Engines this process routes to without running them: fixed URLs (role all), or found by DNS (role gateway:
    a Kubernetes headless Service), re-resolved on an interval."""

    model_config = ConfigDict(extra="forbid")

    engine_urls: CommaList = Field(
        default_factory=list, description="Role all: route to these engines (comma-separated URLs) instead of "
        "starting any (the top-level engine_urls before this section, still accepted)."
    )
    name: str | None = Field(
        None, description="DNS name whose A/AAAA records are the node addresses (e.g. the headless Service "
        "appliance-engines.NAMESPACE.svc.cluster.local); required when role is gateway."
    )
    interval_seconds: float = Field(5.0, gt=0, description="How often the name is resolved again.")
    engines_per_node: int = Field(
        1, ge=1, le=64, description="Engines behind each address, at engine.base_port + i (the node's replicas)."
    )
    nameserver: str | None = Field(
        None, description="host:port of the DNS server to ask (tests, or a resolver other than the system's); "
        "unset: the system resolver (getaddrinfo)."
    )
    resolve_timeout_seconds: float = Field(
        2.0, gt=0, description="One resolution's time limit; a failed resolution keeps the last known engines."
    )
    kv_events: bool = Field(
        False, description="The engines found by discovery (or listed in engine_urls) publish KV-cache events on "
        "their port + engine.kv_events_port_offset, replay on + engine.kv_events_replay_port_offset (nodes run with "
        "engine.kv_events network): the gateway subscribes for precise prefix routing. Off: their prefix cache is "
        "modelled (routing.prefix_cache.mode falls back where allowed)."
    )

    @field_validator("nameserver")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"nameserver must be host:port, got {value!r}")
        return value
