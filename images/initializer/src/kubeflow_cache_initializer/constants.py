"""Names, ports, labels and defaults shared by every module (one place, no magic numbers)."""

# Cache pods: ports and the processes they run (see docs/protocol.md).
FLIGHT_PORT = 50051
FLIGHT_PORT_NAME = "flight"
DEFAULT_HEALTH_PORT = 8080
# Ports below this need privileges the cache pods do not have, unless the pod sets the safe
# sysctl net.ipv4.ip_unprivileged_port_start (builders.py does, for a health port below it).
UNPRIVILEGED_PORT_START = 1024
HEALTH_PORT_NAME = "health"
CACHE_CONTAINER = "cache"
HEAD_ARGS = ("head",)
WORKER_ARGS = ("worker",)
READY_PATH = "/ready"
LIVE_PATH = "/live"
STATUS_PATH = "/status"
TERMINATION_LOG = "/dev/termination-log"

# Liveness: /live answers while a node loads, so a failing one means a wedged process.
LIVENESS_INITIAL_DELAY_SECONDS = 10
LIVENESS_PERIOD_SECONDS = 10
LIVENESS_TIMEOUT_SECONDS = 5
LIVENESS_FAILURE_THRESHOLD = 6

# Restricted pod security: the image's numeric non-root user, read-only root, an emptyDir for /tmp.
TMP_VOLUME = "tmp"
TMP_MOUNT_PATH = "/tmp"

# Defaults of the initializer's env (the Kubeflow SDK usually sets them all).
DEFAULT_CLUSTER_SIZE = 3
DEFAULT_HEAD_CPU = "1"
DEFAULT_HEAD_MEM = "1Gi"
DEFAULT_WORKER_CPU = "2"
DEFAULT_WORKER_MEM = "2Gi"
DEFAULT_READINESS_INITIAL_DELAY_SECONDS = 0
DEFAULT_READINESS_PERIOD_SECONDS = 5
DEFAULT_READINESS_TIMEOUT_SECONDS = 2
DEFAULT_READINESS_FAILURE_THRESHOLD = 3
DEFAULT_READY_TIMEOUT_SECONDS = 600.0
DEFAULT_STATUS_POLL_SECONDS = 5.0
MIN_STATUS_POLL_SECONDS = 0.01  # below it, the head's /status is polled in a tight loop
# A cluster autoscaler needs a few minutes to add a node for an unschedulable cache pod.
DEFAULT_UNSCHEDULABLE_GRACE_SECONDS = 180.0
# An image pull that fails, or a container that cannot start, may pass: the kubelet retries a
# pull after 10, 20, 40 s..., so this leaves room for about three tries.
DEFAULT_START_ERROR_GRACE_SECONDS = 90.0

# Waiting: how long one watch request or one head /status request may take.
MAX_WATCH_SECONDS = 60
# How often an object the garbage collector is about to delete is read again, where the
# initializer may not watch its kind (Services, ServiceAccounts).
GONE_POLL_SECONDS = 1.0
STATUS_HTTP_TIMEOUT_SECONDS = 2.0
API_REQUEST_TIMEOUT_SECONDS = 30.0
# A patch refused for a changed resourceVersion is tried again after a random pause of up to
# PAUSE, doubling to MAX, until the run's deadline, and at least RETRIES times.
PATCH_CONFLICT_RETRIES = 5
PATCH_CONFLICT_PAUSE_SECONDS = 0.05
PATCH_CONFLICT_MAX_PAUSE_SECONDS = 2.0

# Labels and annotations the initializer puts on what it creates.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "data-cache"
MANAGED_BY = "cache-initializer"
COMPONENT_HEAD = "head"
COMPONENT_WORKER = "worker"
ANNOTATION_METADATA_LOC = "data-cache.kubeflow.org/metadata-location"
ANNOTATION_TABLE = "data-cache.kubeflow.org/table"
ANNOTATION_SHARED = "data-cache.kubeflow.org/shared"
EKS_ROLE_ARN_ANNOTATION = "eks.amazonaws.com/role-arn"
EKS_STS_REGIONAL_ANNOTATION = "eks.amazonaws.com/sts-regional-endpoints"

# Names of what is created.
CACHE_NAME_SUFFIX = "-cache"
SERVICE_NAME_SUFFIX = "-cache-service"
# What JobSet's headless Service (named after the JobSet, so the TrainJob) selects its pods by.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# The LeaderWorkerSet controller selects its headless Service (the pods' DNS subdomain) by this.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
SHARED_NAME_PREFIX = "data-cache-"
SHARED_HASH_CHARS = 10

# The pod's namespace, as Kubernetes mounts it.
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# The key a cache's head and data nodes show each other (the cache image's security.py): one
# random key per cache, which both pod templates read from the cache's Secret; readers never need it.
CLUSTER_KEY_ENV = "DATA_CACHE_CLUSTER_KEY"
CLUSTER_KEY_BYTES = 24
# The Secret a cache's pods read the key from: `<cache>-key-<random hex>`, data key `cluster-key`.
KEY_SECRET_INFIX = "-key-"
KEY_SECRET_SUFFIX_BYTES = 4
KEY_SECRET_DATA_KEY = "cluster-key"
# The readers' token (the cache image's DATA_CACHE_TOKEN): the cache pods and the runtime's
# trainers both read it from one Secret of the namespace, optionally, so creating that Secret
# turns token auth on for the namespace's caches and its TrainJobs' readers alike.
TOKEN_ENV = "DATA_CACHE_TOKEN"
DEFAULT_TOKEN_SECRET = "data-cache-token"
TOKEN_SECRET_DATA_KEY = "token"
NO_TOKEN_SECRET = "none"
# Flight TLS, like the token: one `kubernetes.io/tls` Secret of the namespace (tls.crt, tls.key,
# optionally ca.crt) that the cache pods mount as an *optional* volume, so that creating it turns
# TLS on for the namespace's caches without the initializer ever reading a Secret (it has no `get`
# on them). The runtime's trainers mount the same Secret (certificates only) at the same path.
TLS_DIR_ENV = "DATA_CACHE_TLS_DIR"
TLS_SERVER_NAME_ENV = "DATA_CACHE_TLS_SERVER_NAME"
DEFAULT_TLS_SECRET = "data-cache-tls"
NO_TLS_SECRET = "none"
TLS_VOLUME = "data-cache-tls"
TLS_MOUNT_PATH = "/etc/data-cache/tls"
# The object store's CA (MinIO or Ceph behind an internal CA), like the TLS Secret: a ConfigMap
# of the namespace (key `ca.crt`; a CA is no secret) mounted as an *optional* volume, so creating
# it makes the namespace's caches trust the store, without the initializer reading it. The cache
# uses the folder's ca.crt where there is one (kubeflow_data_cache.s3_settings.trust_aws_ca_bundle).
S3_CA_DIR_ENV = "DATA_CACHE_S3_CA_DIR"
DEFAULT_S3_CA_CONFIGMAP = "data-cache-s3-ca"
NO_S3_CA_CONFIGMAP = "none"
S3_CA_VOLUME = "data-cache-s3-ca"
S3_CA_MOUNT_PATH = "/etc/data-cache/s3-ca"
# The name every client checks the certificate against: pods and Services are reached by IP or
# per-job names, which no certificate made ahead of time can list, so the Secret's certificate
# carries this one DNS name (a SAN) and clients check it in place of the address they dial.
TLS_SERVER_NAME = "data-cache"
