"""The object store: S3 settings from the standard AWS environment, the store's CA, and what to
fix when a read from the store fails.

pyarrow's S3 client reports curl's and the AWS SDK's failures as OSError text that names no
setting ("curlCode: 60", "HTTP status 301 ... No response body"): ``store_trouble`` reads that
text and says which setting to check, for the metadata read and the data files alike.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from kubeflow_data_cache.errors import ConfigError

log = logging.getLogger(__name__)

# The region requests are signed for when AWS_ENDPOINT_URL(_S3) is set without AWS_REGION: the
# AWS SDKs' default for S3, and what MinIO and most S3-compatible stores expect.
ENDPOINT_DEFAULT_REGION = "us-east-1"

# A folder that may hold the object store's CA as `ca.crt`: where the initializer mounts the
# namespace's `data-cache-s3-ca` ConfigMap, an optional volume (empty where there is none).
S3_CA_DIR_ENV = "DATA_CACHE_S3_CA_DIR"
S3_CA_FILE = "ca.crt"
# The PEM blocks curl takes as trust anchors: plain certificates, and OpenSSL's "trusted" ones
# (`openssl x509 -trustout`, as in RHEL's ca-bundle.trust.crt).
PEM_CERTIFICATE = re.compile(rb"-----BEGIN (TRUSTED |X509 )?CERTIFICATE-----")


def endpoint_variable(env: dict[str, str] | None = None) -> str:
    """The variable the S3 endpoint is taken from: the service-specific one wins, as in the AWS SDKs."""
    env = os.environ if env is None else env
    return "AWS_ENDPOINT_URL_S3" if env.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"


def s3_properties_from_env(env: dict[str, str] | None = None, warn: bool = True) -> dict[str, str]:
    """pyiceberg FileIO properties from the standard AWS settings.

    Credentials are passed only when set explicitly; otherwise pyarrow's S3 filesystem walks
    the AWS default chain (web identity / IRSA, instance profile, shared credentials file).
    Region and endpoint come from these variables only, not from a profile's config. ``warn``
    False leaves the warnings to the processes that read the store (`local` only checks).
    """
    env = dict(os.environ if env is None else env)
    props: dict[str, str] = {}
    name = endpoint_variable(env)
    endpoint = env.get(name)
    if endpoint:
        # The authority alone: an '@' in the path or query (?x=a@b) is no user name.
        if "@" in re.split(r"[/?#]", endpoint.split("://", 1)[-1], maxsplit=1)[0]:
            # user:password@host: the S3 client took the user name for the host, and every
            # message naming the endpoint (the unauthenticated /ready and /status among them)
            # showed the password. Refused without echoing it.
            raise ConfigError(
                f"{name} holds a user name or password before an '@': the S3 client does not read them (it "
                "took the user name for the host), and they would show wherever the endpoint is named; set "
                f"{name} to the store's URL alone (http://host:port) and give the keys in AWS_ACCESS_KEY_ID "
                "and AWS_SECRET_ACCESS_KEY"
            )
        if endpoint != endpoint.strip():
            # A ConfigMap made from a file keeps its trailing newline: the S3 client then said
            # "Custom endpoint ... was not a valid URI", split over two log lines, naming no setting.
            raise ConfigError(
                f"{name}={endpoint!r} has blanks or a line break around it: set it to the URL alone, "
                f"{endpoint.strip()!r}"
            )
        if not endpoint.lower().startswith(("http://", "https://")):
            # Without a scheme the S3 client assumes https: a plain-HTTP MinIO at minio:9000
            # then fails with "SSL connect error ... wrong version number", naming no setting.
            raise ConfigError(f"{name}={endpoint!r} has no scheme: write http://{endpoint} or https://{endpoint}")
        # The S3 client takes a lower-case scheme only: HTTP://minio:9000 resolved "HTTP" as a host.
        scheme, rest = endpoint.split("://", 1)
        props["s3.endpoint"] = f"{scheme.lower()}://{rest}"
    for variable in TRIMMED_SETTINGS:
        value = env.get(variable)
        if value and value != value.strip():
            # A Secret or ConfigMap made from a file keeps its trailing newline: the S3 client
            # then said "A region must be set" (of a region that is set), the store's HTTP 500
            # or "access was denied", naming no setting. Values are not echoed: keys among them.
            raise ConfigError(
                f"{variable} has blanks or a line break around its value (a Secret or ConfigMap made from a "
                f"file keeps the file's last newline): set {variable} to the value alone"
            )
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if not region and endpoint:
        # Without a region pyiceberg asks public AWS where the bucket lives: seconds per process
        # on a network without AWS, the bucket's name sent out, and a same-named AWS bucket's
        # region used to sign requests for this store. S3-compatible stores take the SDKs' default.
        region = ENDPOINT_DEFAULT_REGION
    if region:
        props["s3.region"] = region
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if bool(key_id) != bool(secret):
        missing = "AWS_SECRET_ACCESS_KEY" if key_id else "AWS_ACCESS_KEY_ID"
        raise ConfigError(
            f"{missing} is not set but {'AWS_ACCESS_KEY_ID' if key_id else 'AWS_SECRET_ACCESS_KEY'} is: set both, or "
            "neither to use the AWS default chain (web identity / IRSA, a profile, the instance role)"
        )
    profile = env.get("AWS_PROFILE") if warn and not (key_id and secret) else None
    if profile and (missing := missing_profile(profile, env)):
        # Not refused: the SDK goes on down its chain (web identity, the instance role), which may sign.
        log.warning("%s", missing)
    props.update(_client_settings(env))
    # Static keys only as a pair, with their session token; a token on its own is ignored, as
    # the AWS SDKs ignore incomplete environment credentials and go on down the chain.
    if key_id and secret:
        props["s3.access-key-id"], props["s3.secret-access-key"] = key_id, secret
        if env.get("AWS_SESSION_TOKEN"):
            props["s3.session-token"] = env["AWS_SESSION_TOKEN"]
    return props


# AWS settings whose value is taken as it stands, so a blank or line break around it is a mistake.
TRIMMED_SETTINGS = (
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
)

# The S3 client's own settings, under the names Arrow's Rust object_store reads them by (the AWS
# SDKs have none for them); the initializer forwards them to the cache pods as every AWS_*
# setting. pyarrow's request timeout is how long a request may wait for the store's next bytes
# (3 s by default): a store slower than that to start an answer failed every load, with nothing
# to set.
TIMEOUT_SETTINGS = {"AWS_TIMEOUT": "s3.request-timeout", "AWS_CONNECT_TIMEOUT": "s3.connect-timeout"}
VIRTUAL_HOSTED_SETTING = "AWS_VIRTUAL_HOSTED_STYLE_REQUEST"
# Plain seconds, or humantime's spellings as object_store reads them: "30s", "500ms", "1min",
# "1m 30s", "2h".
_DURATION_PART = re.compile(r"\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)")
_SECONDS_PER_UNIT = {
    **dict.fromkeys(("ms", "msec", "msecs", "millis", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("", "s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
}
_TRUE_WORDS, _FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _seconds(value: str) -> float | None:
    """A duration in seconds, or None where ``value`` is not one."""
    text, at, total = value.strip().lower(), 0, 0.0
    while at < len(text):
        part = _DURATION_PART.match(text, at)
        if part is None or part["unit"] not in _SECONDS_PER_UNIT or (part["unit"] == "" and at > 0):
            return None
        total += float(part["number"]) * _SECONDS_PER_UNIT[part["unit"]]
        at = part.end()
    return total if text else None


def _client_settings(env: dict[str, str]) -> dict[str, str]:
    props = {}
    for name, prop in TIMEOUT_SETTINGS.items():
        if value := env.get(name):
            seconds = _seconds(value)
            if not seconds:
                raise ConfigError(
                    f"{name}={value!r} should be a positive duration: seconds (30), or 30s, 500ms, 1min, 1m 30s"
                )
            props[prop] = str(seconds)
    if value := env.get(VIRTUAL_HOSTED_SETTING):
        word = value.strip().lower()
        if word not in _TRUE_WORDS + _FALSE_WORDS:
            raise ConfigError(
                f"{VIRTUAL_HOSTED_SETTING}={value!r} should be true (requests to bucket.host, as some stores "
                "require) or false (requests to host/bucket, the default with AWS_ENDPOINT_URL; AWS itself is "
                "always reached at bucket.host)"
            )
        props["s3.force-virtual-addressing"] = "true" if word in _TRUE_WORDS else "false"
    return props


def _profile_files(env: dict[str, str]) -> list[tuple[str, str]]:
    """The shared AWS files and the section name a profile has in each (``[name]`` in the
    credentials file, ``[profile name]`` in the config file, except ``default``)."""
    home = os.path.expanduser("~")
    return [  # the SDKs expand a leading ~ in these two as well
        (os.path.expanduser(env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")), "{}"),
        (os.path.expanduser(env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")), "profile {}"),
    ]


def missing_profile(profile: str, env: dict[str, str]) -> str | None:
    """What is wrong with an AWS_PROFILE that no shared AWS file defines (None where one does):
    the SDK skips it silently and goes on down its chain, to web identity or the instance role,
    else sends the request unsigned, and the store's 403 then read like a profile without
    permission."""
    import configparser

    looked = []
    for path, section in _profile_files(env):
        looked.append(path)
        # Not strict: the SDKs take a section or key given twice, which strict parsing refuses.
        parser = configparser.RawConfigParser(strict=False)
        try:
            with open(path, "rb") as file:
                parser.read_string(file.read().decode("utf-8", errors="replace"))
        except FileNotFoundError:
            continue
        except (OSError, configparser.Error):
            return None  # a file the SDK may still read: not ours to say the profile is not in it
        wanted = section.format(profile) if profile != "default" else "default"
        if parser.has_section(wanted) or (profile == "default" and parser.has_section("profile default")):
            return None
    return (
        f"AWS_PROFILE={profile!r} is in none of the shared AWS files ({', '.join(looked)}), so the S3 client "
        "skips it: its requests are signed by the next credentials of the AWS chain (web identity, the "
        "instance role) or go unsigned; name a profile they define, or set AWS_SHARED_CREDENTIALS_FILE / "
        "AWS_CONFIG_FILE to the files that define it"
    )


def _check_pem(path: str, setting: str) -> None:
    """Refuse a CA file that holds no PEM certificate: curl failed every handshake with it
    ("error adding trust anchors", curlCode 77), which read as a store that cannot be reached."""
    try:
        with open(path, "rb") as file:
            text = file.read()
    except OSError as err:
        raise ConfigError(f"{setting}: cannot read the CA file {path!r} ({err.strerror})") from None
    if not PEM_CERTIFICATE.search(text):
        raise ConfigError(
            f"{setting}: {path!r} holds no PEM certificate (no -----BEGIN CERTIFICATE----- line): give the "
            "store's CA certificate(s) in PEM"
        )


# The CA file trust_aws_ca_bundle made this process's SSL_CERT_FILE, and the setting it came from:
# an SSL_CERT_FILE it set is not one set by hand, and the fix for a CA that fails differs.
_ca_given: tuple[str, str] | None = None


def checked_ca_bundle(environ) -> str | None:
    """The object store's CA file the settings name (AWS_CA_BUNDLE, else ``ca.crt`` in
    DATA_CACHE_S3_CA_DIR where the folder has one), or None; a ConfigError naming the setting
    where the file is missing or holds no certificate. It changes nothing: `local` checks the
    settings its nodes inherit with it before it starts them."""
    bundle = environ.get("AWS_CA_BUNDLE")
    if bundle and not os.path.isfile(bundle):  # checked even where SSL_CERT_FILE wins: a mistake either way
        raise ConfigError(
            f"AWS_CA_BUNDLE={bundle!r} is not a file: give the path of the store's CA certificate(s) in PEM, "
            "or unset it to use the image's trusted CAs"
        )
    if bundle:
        _check_pem(bundle, "AWS_CA_BUNDLE")
    if environ.get(S3_CA_DIR_ENV) and not os.path.isdir(environ[S3_CA_DIR_ENV]):
        # The initializer's optional volume is an empty folder where the ConfigMap is missing, so
        # a folder that is not there is a mistyped path, not a store without a private CA.
        raise ConfigError(
            f"{S3_CA_DIR_ENV}={environ[S3_CA_DIR_ENV]!r} is not a folder: give the folder that holds the "
            f"store's CA as {S3_CA_FILE}, or unset it"
        )
    if not bundle and environ.get(S3_CA_DIR_ENV):
        mounted = os.path.join(environ[S3_CA_DIR_ENV], S3_CA_FILE)
        bundle = mounted if os.path.isfile(mounted) else None
        if bundle:
            _check_pem(bundle, f"{S3_CA_FILE} in {S3_CA_DIR_ENV} (the `data-cache-s3-ca` ConfigMap)")
    return bundle


def trust_aws_ca_bundle(environ) -> None:
    """Make the object store's private CA (MinIO or Ceph behind an internal CA) trusted by
    pyarrow's S3 client, which reads SSL_CERT_FILE (pyiceberg passes it no CA of its own).

    The CA is AWS_CA_BUNDLE (the AWS SDKs' and CLI's setting), else ``ca.crt`` in
    DATA_CACHE_S3_CA_DIR where the folder has one. A SSL_CERT_FILE already set wins. A bundle
    named but missing, or holding no certificate, is refused here: the S3 client would fail every
    TLS handshake with an error that says nothing of the file.
    """
    bundle = checked_ca_bundle(environ)
    given = environ.get("SSL_CERT_FILE")
    if given:
        if bundle and os.path.realpath(bundle) != os.path.realpath(given):
            # Said now: otherwise the first sign is a handshake failure with the store.
            log.warning(
                "SSL_CERT_FILE=%r is set, so the object store's CA in %r is not used: the store is trusted "
                "only if SSL_CERT_FILE holds its CA (unset SSL_CERT_FILE to use the other)",
                given,
                bundle,
            )
        return
    if bundle:
        environ["SSL_CERT_FILE"] = bundle
        if environ is os.environ:  # what an untrusted-certificate error then names: the setting given
            global _ca_given
            source = "AWS_CA_BUNDLE" if environ.get("AWS_CA_BUNDLE") else "the `data-cache-s3-ca` ConfigMap"
            _ca_given = (bundle, source)


def credential_source(env: dict[str, str] | None = None) -> str:
    """Which AWS credentials a request was signed with (never their values), and what to check,
    in the order the SDK's default chain takes them.

    The SDK walks its chain silently: a web-identity exchange that cannot reach STS, or no
    credentials found at all, falls through to the next source or sends the request unsigned,
    and the store's 403 then reads just like a key without permission."""
    env = dict(os.environ if env is None else env)
    if env.get("AWS_ACCESS_KEY_ID"):
        with_token = " with AWS_SESSION_TOKEN" if env.get("AWS_SESSION_TOKEN") else ""
        said = f"signed with the access key in AWS_ACCESS_KEY_ID{with_token}; check that key's secret and its policy"
        if not with_token and env["AWS_ACCESS_KEY_ID"].startswith("ASIA"):
            # AWS's prefix for temporary keys (STS), which are refused without their session token.
            said += "; it is a temporary key (ASIA...), which needs its AWS_SESSION_TOKEN too"
        return said
    if env.get("AWS_PROFILE"):
        return missing_profile(env["AWS_PROFILE"], env) or (
            f"credentials from the profile {env['AWS_PROFILE']!r} of the shared AWS files"
        )
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN"):
        if not os.path.isfile(env["AWS_WEB_IDENTITY_TOKEN_FILE"]):
            # The SDK skips web identity without a word when the token is not there.
            return (
                f"web identity (IRSA) for role {env['AWS_ROLE_ARN']} is set, but its token file "
                f"AWS_WEB_IDENTITY_TOKEN_FILE={env['AWS_WEB_IDENTITY_TOKEN_FILE']!r} does not exist, so the SDK "
                "skipped it: check that the pod's service account token is projected there (EKS mounts it for "
                "a service account annotated with eks.amazonaws.com/role-arn)"
            )
        return (
            f"credentials from web identity (IRSA) for role {env['AWS_ROLE_ARN']}; check that role's policy on "
            "the bucket, and that the pod reaches AWS STS: when the exchange fails the SDK falls back to the "
            "node's instance role, or sends the request unsigned, which is denied the same way"
        )
    if env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI") or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        return "credentials from the container credentials endpoint (EKS Pod Identity, ECS); check that role's policy"
    return (
        "no AWS credentials are set in the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, or AWS_ROLE_ARN with "
        "AWS_WEB_IDENTITY_TOKEN_FILE), so the SDK's default chain was used: a shared credentials file's default "
        "profile, else the node's instance role, else the request went unsigned"
    )


@dataclass(frozen=True)
class StoreTrouble:
    """What went wrong talking to the object store, and what to fix."""

    problem: str
    fix: str


def _ca_fix() -> str:
    given = os.environ.get("SSL_CERT_FILE")
    if given and _ca_given is not None and given == _ca_given[0]:
        return (
            f"the CA given in {_ca_given[1]} ({_ca_given[0]!r}) did not sign the store's certificate: give the "
            "CA that did (or the chain up to it)"
        )
    if given:
        # Set by hand (or by a base image), it wins over AWS_CA_BUNDLE and the mounted ConfigMap,
        # so naming those alone sent the reader to a setting that was already right.
        return (
            f"SSL_CERT_FILE={given!r} is the CA file in use, and it wins over AWS_CA_BUNDLE and the "
            f"`data-cache-s3-ca` ConfigMap: put the store's CA in it, or unset it"
        )
    return (
        "give the store's CA: AWS_CA_BUNDLE, or on Kubernetes a ConfigMap `data-cache-s3-ca` with key "
        f"`{S3_CA_FILE}` in the TrainJob's namespace (mounted at {S3_CA_DIR_ENV})"
    )


def _timeout_now() -> str:
    given = os.environ.get("AWS_TIMEOUT")
    return f"now {given}" if given else "3 s unless set, e.g. AWS_TIMEOUT=30s"


def _endpoint_as(endpoint: str, scheme: str) -> str:
    """The endpoint setting, written with ``scheme`` in place of its own: the fix to give."""
    return f"{endpoint_variable()}={scheme}://{endpoint.split('://', 1)[1]}"


def _unreachable(endpoint: str | None, err: BaseException) -> StoreTrouble:
    if endpoint:
        name = endpoint_variable()
        fix = f"check that {name} names the store's host and port, reachable from here"
        if "wrong version number" in str(err) and endpoint.lower().startswith("https://"):
            fix = f"the store answered in plain HTTP: write {_endpoint_as(endpoint, 'http')}"
        elif "curlCode: 56" in str(err) and endpoint.lower().startswith("http://"):
            # Connected, then the connection was reset: what a TLS-only port does to plain HTTP.
            fix += f"; if the store serves HTTPS there, write {_endpoint_as(endpoint, 'https')}"
        return StoreTrouble(f"cannot reach the object store at {endpoint} ({name})", fix)
    return StoreTrouble(
        "cannot reach AWS S3 (no AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL is set)",
        "for an S3-compatible store (MinIO, Ceph) set AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL to its URL",
    )


def store_trouble(err: BaseException, endpoint: str | None) -> StoreTrouble | None:
    """What to fix for an error the S3 client raised reading from the store at ``endpoint`` (None:
    AWS itself); None where its text names nothing known."""
    if not isinstance(err, OSError):
        return None
    text = str(err)
    if isinstance(err, PermissionError) or "ACCESS_DENIED" in text:
        return StoreTrouble(
            "access was denied", f"check the AWS credentials or the pod's IAM role: {credential_source()}"
        )
    # curl's certificate check (curlCode 60): a CA not trusted, or a certificate for another name.
    if "SSL peer certificate" in text or "curlCode: 60" in text:
        if "subject name" in text:  # "no alternative certificate subject name matches target ..."
            where = endpoint_variable() if endpoint else "the store's address"
            return StoreTrouble(
                "the object store's certificate does not name the host it was reached at",
                f"reach the store by a name its certificate carries (in {where}), or give it a certificate "
                "for this one",
            )
        return StoreTrouble("the object store's certificate is not trusted", _ca_fix())
    # curlCode 77: the CA file itself could not be used (a bundle set by hand in SSL_CERT_FILE).
    if "curlCode: 77" in text:
        return StoreTrouble(
            "the CA file for the object store could not be loaded",
            "check that SSL_CERT_FILE (or AWS_CA_BUNDLE) names a readable file of PEM certificates",
        )
    # curl could not talk to the store (refused, silent, TLS to a plain-HTTP port): its text names
    # neither the endpoint nor the setting it came from.
    # curl's low-speed limit (curlCode 28, "Operation too slow"): connected, then nothing came,
    # from a store that stalled mid-read or from another service at that port. "Cannot reach"
    # sent the reader to check an address that had worked for every earlier read.
    if "Operation too slow" in text:
        if endpoint:
            name = endpoint_variable()
            return StoreTrouble(
                f"the object store at {endpoint} ({name}) was reached but stopped answering (a request timed out)",
                f"check the store's health and load, and that {name} names the store itself, not another service; "
                f"a store that is slow to answer can be given longer with AWS_TIMEOUT ({_timeout_now()})",
            )
        return StoreTrouble(
            "AWS S3 was reached but stopped answering (a request timed out)",
            "check the network between this pod and S3 (a proxy or NAT gateway), then restart the cache; a slow "
            f"path can be given longer with AWS_TIMEOUT ({_timeout_now()})",
        )
    # The store's own refusals past the S3 client's retries: throttling (503 SlowDown) and its
    # failures (500), which the AWS text names without saying what to do.
    if "SLOW_DOWN" in text or "SERVICE_UNAVAILABLE" in text or "HTTP status 503" in text:
        return StoreTrouble(
            "the object store kept refusing requests as too many (503 SlowDown), past the S3 client's retries",
            "restart the cache once the store's load drops, or give the store more capacity; fewer data nodes "
            "send fewer requests at once",
        )
    # Not the SDK's own INTERNAL_FAILURE for an answer it could not take in ("Failed to flush
    # response stream": an error body larger than a small ranged read), whatever the store said.
    if ("INTERNAL_FAILURE" in text or "HTTP status 500" in text) and "Failed to flush response stream" not in text:
        return StoreTrouble(
            "the object store failed the requests (HTTP 500), past the S3 client's retries",
            "check the store's health and logs, then restart the cache",
        )
    if "NETWORK_CONNECTION" in text:
        return _unreachable(endpoint, err)
    # AWS answers a request sent to the wrong region's endpoint with a 301 (PermanentRedirect),
    # which a HEAD request carries without a body: the only sign is the status.
    if "HTTP status 301" in text or "PermanentRedirect" in text:
        return StoreTrouble(
            "the bucket is in another region than the one requests were sent to",
            "set AWS_REGION to the bucket's region",
        )
    # A HEAD request's 400 carries no body, so the AWS error (InvalidToken, a wrong region) is lost.
    if "HTTP status 400" in text:
        fix = (
            "on S3 that is usually an invalid or expired AWS_SESSION_TOKEN, or an AWS_REGION other than the "
            "bucket's: check the AWS credentials and the region"
        )
        if endpoint and endpoint.lower().startswith("http://"):
            # MinIO (Go's HTTP server) answers plain HTTP on its TLS port with a 400 alone.
            fix += (
                f"; or, if the store serves HTTPS only (a plain-HTTP request to a TLS port is answered 400), "
                f"write {_endpoint_as(endpoint, 'https')}"
            )
        return StoreTrouble("the request was refused as a bad request", fix)
    return None
