"""The initializer's errors: each one ends the run with a non-zero exit and one clear line."""


class InitializerError(Exception):
    """Base class: anything that stops the initializer from delivering a ready cache."""

    exit_code = 1


class ConfigError(InitializerError):
    """The env is missing a value or holds one of the wrong form."""

    exit_code = 2


class KubeApiError(InitializerError):
    """The Kubernetes API answered an error that the initializer cannot work around."""

    def __init__(
        self,
        verb: str,
        what: str,
        status: int,
        reason: str,
        message: str,
        retry_after: float | None = None,
        hint: str | None = None,
        details: dict | None = None,
    ):
        self.verb = verb
        self.what = what
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after  # seconds, from the answer's Retry-After header
        self.retried_seconds: float | None = None  # how long the call was retried before this
        self.hint = hint  # what to do about it, where the answer says (rbac.forbidden_hint)
        self.details = details or {}  # the Status answer's details: the object's name, group and kind
        super().__init__(f"{verb} {what} failed: HTTP {status} {reason}: {message}")

    def __str__(self) -> str:
        text = super().__str__()
        if self.retried_seconds is not None:
            text += f" (still failing after {self.retried_seconds:.0f}s of retries)"
        if self.hint:
            text += f"; {self.hint}"
        return text

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def kind_not_served(self) -> bool:
        """A 404 for the kind itself (its API group and version not installed), not for one
        object: the API names a missing object in the answer's details, and no object here."""
        # Newer API servers say so in a Status; older ones answered an unserved group with Go's
        # plain-text "404 page not found".
        return (
            self.status == 404
            and not self.details.get("name")
            and any(words in self.message for words in ("could not find the requested resource", "404 page not found"))
        )

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def conflict(self) -> bool:
        return self.status == 409 and self.reason != "AlreadyExists"

    @property
    def gone(self) -> bool:
        return self.status == 410


class MissingGrantsError(InitializerError):
    """The initializer's ServiceAccount lacks calls it makes (found before it makes anything)."""


class TrainJobNotFoundError(InitializerError):
    """`TRAIN_JOB_NAME` names no TrainJob in the pod's namespace, or the cluster does not serve
    the TrainJob API at all."""


class ForeignObjectError(InitializerError):
    """An object with the cache's name exists but belongs to something else."""


class CacheTimeoutError(InitializerError):
    """The cache was not ready before `CACHE_READY_TIMEOUT_SECONDS`."""


class CacheFailedError(InitializerError):
    """The cache can never become ready: image pull error, OOMKilled, unschedulable, load error."""


class CacheDeletedError(CacheFailedError):
    """The cache's LeaderWorkerSet was deleted while the run waited for it: no settings at fault."""


class TerminatedError(InitializerError):
    """SIGTERM before the cache was ready: the pod deleted or evicted, or its TrainJob suspended."""

    exit_code = 143  # 128 + SIGTERM, as a shell reports a process the signal ended
