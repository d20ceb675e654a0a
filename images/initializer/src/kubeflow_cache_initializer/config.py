"""The initializer's settings: parsed once from the env, typed, every error named.

`load_config` reads every variable, collects every problem and raises one `ConfigError`
whose message names each bad variable, the value it got and the form it expects.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from kubernetes.utils import parse_quantity

from kubeflow_cache_initializer import constants as c
from kubeflow_cache_initializer.errors import ConfigError
from kubeflow_cache_initializer.placement import (
    DNS_SUBDOMAIN,
    NODE_SELECTOR_FORM,
    TOLERATIONS_FORM,
    parse_node_selector,
    parse_tolerations,
)

STORAGE_URI_SCHEME = "cache://"
METADATA_LOC_SCHEMES = ("s3://", "s3a://", "file://")
# A plain decimal number ("2", "1.5", ".5"), the start of every number form below.
_NUMBER = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)"
# A Kubernetes resource.Quantity ("1", "500m", "2Gi", "1.5e3").
_QUANTITY = re.compile(_NUMBER + r"([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")
# A cache pod's interpreter (pyarrow, pyiceberg, gRPC) takes about 130-200 MiB before any row,
# and a data node's own memory check keeps 400 MiB aside for it: less is a typo ("500m", "512").
MIN_MEMORY_BYTES = 400 << 20
# Per pod, past any node's memory (the largest cloud machines have 24-32 TiB): "2000Gi" meant for
# "2000Mi", or "1e20", left the pods unschedulable until the unschedulable grace ran out.
MAX_MEMORY_BYTES = 64 << 40
# A CPU amount is cores or millicores: other suffixes are valid quantities but not meant ("500M",
# 500 million cores, for "500m"; "2Gi"), and left the cache pods unschedulable for minutes.
_CPU = re.compile(_NUMBER + "m?")
MAX_CPUS = 1024  # per pod: past any node's
# CLUSTER_SIZE: the head and at most the cache's 2^14 data nodes.
MAX_CLUSTER_SIZE = (1 << 14) + 1
# The Kubernetes API's probe fields are int32: a larger value passes here, but the LWS webhook
# refuses the whole LeaderWorkerSet with a decode error, after the Service is created.
MAX_INT32 = (1 << 31) - 1
# Plain decimal digits: int() and float() also take "1_0" (10) and other scripts' digits.
_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(_NUMBER + r"([eE][+-]?[0-9]+)?")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label: may start with a digit
# IAM names are ASCII letters, digits and +=,.@_- (a path adds /); ``\w`` took any letter.
_IAM_ROLE = re.compile(r"^arn:aws[a-z-]*:iam::[0-9]{12}:role/[A-Za-z0-9_+=,.@/-]+$")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")  # core/v1 Container.imagePullPolicy
_TABLE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# `{TRAIN_JOB_NAME}-cache` names the LeaderWorkerSet, whose StatefulSets (`<name>` and `<name>-0`)
# must stay within 52 characters for their pods' controller-revision-hash label to fit in 63.
MAX_TRAIN_JOB_NAME = 52 - len("-0") - len(c.CACHE_NAME_SUFFIX)
T = TypeVar("T")
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off", "")

# AWS_* variables that are forwarded to cache pods, except these: secrets (pass them with
# `CACHE_ENV_FROM_SECRET`) and what EKS injects into each pod for its own identity.
AWS_PREFIX = "AWS_"
# Static credentials: where the initializer has these, it was given them for the cache (a
# Secret in the TrainJob's dataset.secretRef, or its env), and it says how they get there.
AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
AWS_NOT_FORWARDED = frozenset(
    {
        *AWS_CREDENTIALS,
        "AWS_ROLE_ARN",
        "AWS_ROLE_SESSION_NAME",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_CONFIG_FILE",
        "AWS_PROFILE",
    }
)

# Any other AWS_* whose name says it holds a secret (AWS_SECRET_KEY, AWS_ACCESS_KEY, a service's
# AWS_BEARER_TOKEN_...): copied as a plain value, it was in the LeaderWorkerSet's spec, which the
# namespace's `view` role reads. Not forwarded, and named with the credentials.
SECRET_LIKE_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY(_|$)")


# Names the pattern would catch that hold no secret: ids, ARNs, files and endpoints
# (AWS_KMS_KEY_ID, AWS_KMS_KEY_ARN, AWS_CREDENTIAL_PROFILES_FILE, AWS_ENDPOINT_URL_SECRETS_MANAGER).
NOT_SECRET_ENDINGS = ("_ID", "_ARN", "_FILE")


def _secret_like(name: str) -> bool:
    """An AWS_* credential, or another AWS_* whose name says it holds a secret (not what EKS or
    a profile injects per pod: that is identity, not given for the cache)."""
    if not name.startswith(AWS_PREFIX):
        return False
    if name in AWS_CREDENTIALS:
        return True
    if name in AWS_NOT_FORWARDED or name.endswith(NOT_SECRET_ENDINGS) or name.startswith("AWS_ENDPOINT_URL"):
        return False  # per-pod identity (EKS, a profile), or an id, ARN, file or endpoint
    return bool(SECRET_LIKE_NAME.search(name.removeprefix(AWS_PREFIX)))


@dataclass(frozen=True)
class Probe:
    """The readiness probe's timing, as the SDK passes it."""

    initial_delay_seconds: int
    period_seconds: int
    timeout_seconds: int
    failure_threshold: int


@dataclass(frozen=True)
class Config:
    """Everything the initializer needs, checked."""

    storage_uri: str
    schema_name: str
    table_name: str
    metadata_loc: str
    train_job_name: str
    namespace: str
    cache_image: str
    cluster_size: int
    head_cpu: str
    head_mem: str
    worker_cpu: str
    worker_mem: str
    iam_role: str | None
    readiness: Probe
    ready_timeout_seconds: float
    shared: bool
    cache_env: tuple[tuple[str, str], ...]
    env_from_secrets: tuple[str, ...]
    image_pull_secrets: tuple[str, ...]
    image_pull_policy: str | None  # None: Kubernetes' default (Always for :latest, else IfNotPresent)
    credentials_seen: tuple[str, ...]  # AWS credentials (and secret-like AWS_*) of this env, which no pod spec gets
    token_secret: str | None  # the namespace's Secret the readers' token is read from, if there
    tls_secret: str | None  # the namespace's TLS Secret the cache pods mount, if there
    s3_ca_configmap: str | None  # the namespace's ConfigMap of the store's CA the cache pods mount, if there
    node_selector: tuple[tuple[str, str], ...]
    tolerations: tuple[dict[str, Any], ...]
    health_port: int
    status_poll_seconds: float
    unschedulable_grace_seconds: float
    start_error_grace_seconds: float

    @property
    def data_nodes(self) -> int:
        return self.cluster_size - 1


class _Reader:
    """Reads variables from one env mapping, collecting every problem instead of stopping."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self.problems: list[str] = []

    def _bad(self, name: str, expected: str, got: str) -> None:
        self.problems.append(f"`{name}` should be {expected}, got {got!r}")

    def text(self, name: str, expected: str, default: str | None = None) -> str:
        value = self.env.get(name, "").strip()
        if value:
            return value
        if default is None:
            self.problems.append(f"`{name}` is required: {expected}")
        return default or ""

    def matching(self, name: str, pattern: re.Pattern[str], expected: str, default: str | None = None) -> str:
        value = self.text(name, expected, default)
        if value and not pattern.fullmatch(value):
            self._bad(name, expected, value)
        return value

    def integer(self, name: str, default: int, minimum: int, maximum: int | None = None) -> int:
        raw = self.env.get(name, "").strip()
        if not raw:
            return default
        bounds = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        if not _DIGITS.fullmatch(raw):
            self._bad(name, bounds, raw)
            return default
        value = int(raw)
        if value < minimum or (maximum is not None and value > maximum):
            self._bad(name, bounds, raw)
        return value

    def seconds(self, name: str, default: float, least: float = 0.0) -> float:
        """Seconds > 0 (at least ``least`` where given: a poll interval of 1e-9 s polled in a
        tight loop)."""
        raw = self.env.get(name, "").strip()
        if not raw:
            return default
        value = float(raw) if _DECIMAL.fullmatch(raw) else -1.0
        # Past what a thread can wait for, a wait raises OverflowError when it is reached; the
        # cache, handed the ready timeout as its startup deadline, refuses such a value too.
        if not (0 < value <= threading.TIMEOUT_MAX and value >= least):
            lower = f">= {least:g}" if least else "> 0"
            self._bad(name, f"a number of seconds {lower} and <= {int(threading.TIMEOUT_MAX)}", raw)
            return default
        return value

    def parsed(self, name: str, parse: Callable[[str], T], expected: str, default: T) -> T:
        """``parse(value)``, or ``default`` with the parser's reason among the problems."""
        raw = self.env.get(name, "")
        try:
            return parse(raw)
        except ValueError as err:
            self.problems.append(f"`{name}` should be {expected}: {err}, got {raw.strip()!r}")
            return default

    def flag(self, name: str) -> bool:
        raw = self.env.get(name, "").strip().lower()
        if raw in TRUE_WORDS:
            return True
        if raw not in FALSE_WORDS:
            self._bad(name, f"one of {', '.join(TRUE_WORDS + FALSE_WORDS[:-1])}", self.env[name])
        return False


def _check_memory(r: _Reader, name: str, value: str) -> None:
    """Memory quantities that cannot be meant: millibytes, and less than the interpreter needs."""
    if not _QUANTITY.fullmatch(value):
        return  # already named as malformed
    if value[-1:] in ("m", "u", "n"):
        r._bad(name, f"a memory size such as {value[:-1]}Mi ({value[-1]} means a thousandth of a byte)", value)
        return
    if parse_quantity(value) < MIN_MEMORY_BYTES:
        r._bad(name, f"at least {MIN_MEMORY_BYTES >> 20}Mi (a cache pod's interpreter alone needs about that)", value)
    elif parse_quantity(value) > MAX_MEMORY_BYTES:
        r._bad(name, f"at most {MAX_MEMORY_BYTES >> 40}Ti per pod (more than any node holds)", value)


def _check_cpu(r: _Reader, name: str, value: str) -> None:
    """CPU amounts that cannot be meant: other suffixes than m, none at all, more than a node."""
    if not _QUANTITY.fullmatch(value):
        return  # already named as malformed
    if not _CPU.fullmatch(value):
        r._bad(name, "a CPU amount in cores or millicores, such as 2, 1.5 or 500m", value)
    elif not Decimal("0.001") <= parse_quantity(value) <= MAX_CPUS:  # a Decimal: 0.001 as a float is more
        r._bad(name, f"at least 1m (a thousandth of a core) and at most {MAX_CPUS} cores", value)


def _lower_scheme(location: str) -> str:
    """``S3://bucket/key`` as ``s3://bucket/key``: schemes are case-insensitive (the SDK passes
    what the user wrote, and the upstream cache lowercases it), the cache pods get lower case."""
    scheme, sep, rest = location.partition("://")
    return f"{scheme.lower()}{sep}{rest}" if sep and scheme.isascii() and scheme.isalnum() else location


def _names_a_file(location: str) -> bool:
    """Whether an s3://, s3a:// or file:// URI names a file (a bucket and a key; a path): `s3://`
    alone would only fail in the cache pods, after they started."""
    scheme = next((s for s in METADATA_LOC_SCHEMES if location.startswith(s)), None)
    if scheme is None:
        return False
    rest = location[len(scheme) :]
    if scheme == "file://":
        return rest.strip("/") != ""
    bucket, _, key = rest.partition("/")
    return bucket != "" and key.strip("/") != ""


def parse_storage_uri(uri: str) -> tuple[str, str]:
    """`cache://<schema>/<table>` -> (schema, table); ValueError when it is not of that form."""
    if not uri.startswith(STORAGE_URI_SCHEME):
        raise ValueError("no cache:// scheme")
    parts = uri[len(STORAGE_URI_SCHEME) :].split("/")
    if len(parts) != 2 or not all(_TABLE_PART.fullmatch(p) for p in parts):
        raise ValueError("not exactly <schema>/<table>")
    return parts[0], parts[1]


def _namespace(env: Mapping[str, str], namespace_file: Path) -> str | None:
    for name in ("NAMESPACE", "POD_NAMESPACE"):
        if env.get(name, "").strip():
            return env[name].strip()
    try:
        return namespace_file.read_text().strip() or None
    except OSError:
        return None


def _forwarded_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted(
            (name, value)
            for name, value in env.items()
            if name.startswith(AWS_PREFIX) and name not in AWS_NOT_FORWARDED and not _secret_like(name) and value
        )
    )


def is_secret_name(name: str) -> bool:
    """A Secret's name: a DNS-1123 subdomain of at most 253 characters."""
    return bool(DNS_SUBDOMAIN.fullmatch(name)) and len(name) <= 253


def _secret_names(r: _Reader, env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated list of Secret names (DNS-1123 subdomains), each checked."""
    secrets = tuple(s.strip() for s in env.get(name, "").split(",") if s.strip())
    for secret in secrets:
        if not is_secret_name(secret):
            r._bad(name, "comma-separated Secret names (DNS-1123 subdomains)", secret)
    return secrets


def _pull_policy(r: _Reader, name: str) -> str | None:
    """One of core/v1's imagePullPolicy values, matched without regard to case (`always` is
    plainly meant as `Always`, which the API server alone would refuse), or None when unset."""
    raw = r.env.get(name, "").strip()
    if not raw:
        return None
    for policy in PULL_POLICIES:
        if raw.lower() == policy.lower():
            return policy
    r._bad(name, " or ".join(PULL_POLICIES) + " (or unset: Kubernetes' default)", raw)
    return None


def _optional_secret(
    r: _Reader, env: Mapping[str, str], var: str, default: str, none: str, kind: str = "Secret"
) -> str | None:
    """A namespace Secret (or ConfigMap: ``kind``) the cache pods read where it exists (`var`,
    else ``default``), or None for ``none``: CACHE_TOKEN_SECRET (data key `token`:
    DATA_CACHE_TOKEN), CACHE_TLS_SECRET (a `kubernetes.io/tls` Secret, mounted as an optional
    volume to serve Flight TLS with) and CACHE_S3_CA_CONFIGMAP (the object store's CA)."""
    name = env.get(var, "").strip() or default
    if name == none:
        return None
    if not is_secret_name(name):
        r._bad(var, f"a {kind} name (a DNS-1123 subdomain), or {none}", name)
    return name


def load_config(env: Mapping[str, str], namespace_file: Path = Path(c.NAMESPACE_FILE)) -> Config:
    """Parse and check every setting; raise one `ConfigError` listing every problem."""
    r = _Reader(env)
    storage_uri = r.text("STORAGE_URI", "cache://<schema>/<table>")
    schema_name = table_name = ""
    if storage_uri:
        try:
            schema_name, table_name = parse_storage_uri(storage_uri)
        except ValueError:
            r._bad("STORAGE_URI", "cache://<schema>/<table> (letters, digits, _ . -)", storage_uri)
    metadata_loc = _lower_scheme(r.text("METADATA_LOC", "the table's metadata.json as an s3://, s3a:// or file:// URI"))
    if metadata_loc and not _names_a_file(metadata_loc):
        r._bad("METADATA_LOC", "an s3://bucket/key, s3a://bucket/key or file:///path URI of the table's metadata.json",
               metadata_loc)  # fmt: skip
    train_job_name = r.matching(
        "TRAIN_JOB_NAME", _DNS_LABEL, f"the TrainJob's name (a DNS-1035 label of at most {MAX_TRAIN_JOB_NAME} chars)"
    )
    if len(train_job_name) > MAX_TRAIN_JOB_NAME:
        r._bad("TRAIN_JOB_NAME", f"at most {MAX_TRAIN_JOB_NAME} characters long", train_job_name)
    cache_image = r.text("CACHE_IMAGE", "the data cache image, e.g. ghcr.io/org/data-cache:0.1.0")
    if cache_image and any(ch.isspace() for ch in cache_image):
        r._bad("CACHE_IMAGE", "an image reference without spaces", cache_image)
    cluster_size = r.integer("CLUSTER_SIZE", c.DEFAULT_CLUSTER_SIZE, minimum=2, maximum=MAX_CLUSTER_SIZE)
    cpus = "a Kubernetes quantity such as 500m, 2 or 1.5"
    memory = "a Kubernetes quantity such as 512Mi, 4Gi or 8G"
    head_cpu = r.matching("HEAD_CPU", _QUANTITY, cpus, c.DEFAULT_HEAD_CPU)
    head_mem = r.matching("HEAD_MEM", _QUANTITY, memory, c.DEFAULT_HEAD_MEM)
    worker_cpu = r.matching("WORKER_CPU", _QUANTITY, cpus, c.DEFAULT_WORKER_CPU)
    worker_mem = r.matching("WORKER_MEM", _QUANTITY, memory, c.DEFAULT_WORKER_MEM)
    for name, value in (("HEAD_MEM", head_mem), ("WORKER_MEM", worker_mem)):
        _check_memory(r, name, value)
    for name, value in (("HEAD_CPU", head_cpu), ("WORKER_CPU", worker_cpu)):
        _check_cpu(r, name, value)
    iam_role = r.matching("IAM_ROLE", _IAM_ROLE, "an IAM role ARN, arn:aws:iam::<account>:role/<name>", "") or None
    readiness = Probe(
        initial_delay_seconds=r.integer(
            "READINESS_INITIAL_DELAY_SECONDS", c.DEFAULT_READINESS_INITIAL_DELAY_SECONDS, minimum=0, maximum=MAX_INT32
        ),
        period_seconds=r.integer(
            "READINESS_PERIOD_SECONDS", c.DEFAULT_READINESS_PERIOD_SECONDS, minimum=1, maximum=MAX_INT32
        ),
        timeout_seconds=r.integer(
            "READINESS_TIMEOUT_SECONDS", c.DEFAULT_READINESS_TIMEOUT_SECONDS, minimum=1, maximum=MAX_INT32
        ),
        failure_threshold=r.integer(
            "READINESS_FAILURE_THRESHOLD", c.DEFAULT_READINESS_FAILURE_THRESHOLD, minimum=1, maximum=MAX_INT32
        ),
    )
    ready_timeout = r.seconds("CACHE_READY_TIMEOUT_SECONDS", c.DEFAULT_READY_TIMEOUT_SECONDS)
    shared = r.flag("DATA_CACHE_SHARED")
    secrets = _secret_names(r, env, "CACHE_ENV_FROM_SECRET")
    pull_secrets = _secret_names(r, env, "CACHE_IMAGE_PULL_SECRETS")
    pull_policy = _pull_policy(r, "CACHE_IMAGE_PULL_POLICY")
    token_secret = _optional_secret(r, env, "CACHE_TOKEN_SECRET", c.DEFAULT_TOKEN_SECRET, c.NO_TOKEN_SECRET)
    tls_secret = _optional_secret(r, env, "CACHE_TLS_SECRET", c.DEFAULT_TLS_SECRET, c.NO_TLS_SECRET)
    s3_ca_configmap = _optional_secret(
        r, env, "CACHE_S3_CA_CONFIGMAP", c.DEFAULT_S3_CA_CONFIGMAP, c.NO_S3_CA_CONFIGMAP, kind="ConfigMap"
    )
    node_selector = r.parsed("CACHE_NODE_SELECTOR", parse_node_selector, NODE_SELECTOR_FORM, {})
    tolerations = r.parsed("CACHE_TOLERATIONS", parse_tolerations, TOLERATIONS_FORM, ())
    health_port = r.integer("CACHE_HEALTH_PORT", c.DEFAULT_HEALTH_PORT, minimum=1, maximum=65535)
    if health_port == c.FLIGHT_PORT:
        r._bad("CACHE_HEALTH_PORT", f"a port other than the Flight port {c.FLIGHT_PORT}", str(health_port))
    status_poll = r.seconds("CACHE_STATUS_POLL_SECONDS", c.DEFAULT_STATUS_POLL_SECONDS, least=c.MIN_STATUS_POLL_SECONDS)
    unschedulable_grace = r.seconds("CACHE_UNSCHEDULABLE_GRACE_SECONDS", c.DEFAULT_UNSCHEDULABLE_GRACE_SECONDS)
    start_error_grace = r.seconds("CACHE_START_ERROR_GRACE_SECONDS", c.DEFAULT_START_ERROR_GRACE_SECONDS)
    namespace = _namespace(env, namespace_file)
    if namespace is None:
        r.problems.append(f"`NAMESPACE` is required outside a pod (no {namespace_file} to read it from)")
    elif not _NAMESPACE.fullmatch(namespace):
        # Else every call failed as if the TrainJob were missing (exit 1, and a retry for nothing).
        r.problems.append(
            f"`NAMESPACE` should be a namespace name (at most 63 lowercase letters, digits and '-', "
            f"starting and ending with a letter or digit), got {namespace!r}"
        )
    if r.problems:
        raise ConfigError("invalid configuration: " + "; ".join(r.problems))
    return Config(
        storage_uri=storage_uri,
        schema_name=schema_name,
        table_name=table_name,
        metadata_loc=metadata_loc,
        train_job_name=train_job_name,
        namespace=namespace or "",
        cache_image=cache_image,
        cluster_size=cluster_size,
        head_cpu=head_cpu,
        head_mem=head_mem,
        worker_cpu=worker_cpu,
        worker_mem=worker_mem,
        iam_role=iam_role,
        readiness=readiness,
        ready_timeout_seconds=ready_timeout,
        shared=shared,
        cache_env=_forwarded_env(env),
        credentials_seen=tuple(sorted(name for name, value in env.items() if _secret_like(name) and value.strip())),
        env_from_secrets=secrets,
        image_pull_secrets=pull_secrets,
        image_pull_policy=pull_policy,
        token_secret=token_secret,
        tls_secret=tls_secret,
        s3_ca_configmap=s3_ca_configmap,
        node_selector=tuple(node_selector.items()),
        tolerations=tolerations,
        health_port=health_port,
        status_poll_seconds=status_poll,
        unschedulable_grace_seconds=unschedulable_grace,
        start_error_grace_seconds=start_error_grace,
    )
