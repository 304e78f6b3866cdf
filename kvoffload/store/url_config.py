"""Store URLs: the grammar, written once here, next to its parser. A URL is parsed and validated once
into a typed spec, through one registry: scheme -> parser -> spec -> opener (`opening.py`). Everything
that needs a store option (the stores, the vLLM scheduler's mirror of a memory tier, `verify`) reads the
spec, never the URL again. `spec.url()` is the canonical URL, its passwords replaced by *** (for logs and
errors); `spec.url(redact=False)` parses back to an equal spec.

    memory://?capacity=4GiB&pinned=auto&reserve=auto&evict=lru           one process's host memory
        capacity   the arena's hard byte cap (default 4GiB)
        pinned     auto | true | false: page-locked (default auto: when CUDA or ROCm is present; true
                   without one is an error at open)
        reserve    auto | true | false: allocate the whole capacity at open (default auto: when pinned,
                   so no save waits for page-locking)
        evict      lru | s3fifo: which entry a full tier evicts (eviction.py; default lru)

    lmdb:///abs/dir?capacity=16GiB&evict=lru                             LMDB on local disk
        the path   an absolute directory (created 0700 if missing)
        capacity   the hard cap on disk space (default 16GiB; the file is allocated at open, x1.3125)
        evict      lru | s3fifo (default lru); kept in the file: a store with entries keeps its own

    redis://[user[:password]@]host[:port]/db?namespace=default&timeout=2&capacity=
    rediss://...   TLS: adds ssl_ca_certs=, ssl_certfile=, ssl_keyfile=, ssl_cert_reqs=required|optional|none
    redis+cluster://[user[:password]@]host:port,host:port/?...  (rediss+cluster:// with TLS): seed nodes
        host:port  port 6379 if left out; one host unless +cluster; a cluster takes no database number
        db         the database number (default 0)
        namespace  keys are kvoffload:<namespace>:<page key> (default "default")
        timeout    seconds any call may wait, a positive number (default 2)
        capacity   the tier's declared size (default: the servers' maxmemory)
        ssl_*      passed to redis-py, only with rediss:// (ssl_cert_reqs default required)

    s3://bucket/prefix?endpoint=https://host:port&region=us-east-1&namespace=default&capacity=1TiB&timeout=5
        bucket     the bucket (it must exist); prefix: an optional key prefix inside it
        endpoint   the S3 endpoint's URL (default: AWS's for the region); http:// is allowed
        region     the region to sign for (default us-east-1)
        namespace  objects are <prefix>/kvoffload:<namespace>:<page key, hex> (default "default")
        capacity   the bytes the tier keeps under prefix; the least recently used objects are deleted
                   beyond it (default 1TiB)
        timeout    seconds any request may take, a positive number (default 5)
        Credentials never go in the URL: the standard chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
        AWS_SESSION_TOKEN, AWS_PROFILE in ~/.aws/credentials, web identity, instance metadata).

    mooncake://master-host:port?metadata=http://host:8080/metadata&segment=1GiB&buffer=128MiB&namespace=default
        master-host:port  the Mooncake master's RPC address (port 50051 if left out)
        metadata   the metadata server's URL (default http://<master host>:8080/metadata, the master's own
                   HTTP metadata server)
        protocol   tcp | rdma (default tcp); device: the RDMA device names, comma-separated (rdma only)
        local      the address other hosts reach this process at (default: the one that reaches the master)
        segment    the memory this process contributes to the pool (default 1GiB; 0: a client only, for a
                   pool that long-lived contributors hold)
        buffer     this process's transfer buffer; a value must fit in it (default 128MiB)
        namespace  keys are kvoffload:<namespace>:<page key, hex> (default "default")
        timeout    seconds any call may take, a positive number (default 5)
        capacity   the tier's declared size (default: segment)

    tiered://?memory=4GiB&lmdb=/abs/dir&lmdb_capacity=16GiB&redis=<redis URL>&write=behind ...
        one memory tier in front of LMDB, of a shared tier (Redis, S3 or Mooncake), or of LMDB in front of
        a shared tier; lmdb= and/or one of redis=, s3= and mooncake=
        memory         the memory tier's capacity (default 4GiB)
        pinned, reserve, evict   the memory tier's, as memory://'s
        lmdb           the LMDB tier's absolute directory
        lmdb_capacity  its capacity (default 16GiB)
        lmdb_evict     its eviction policy, lru | s3fifo (default lru; needs lmdb=)
        redis          a redis://, rediss:// or redis+cluster:// URL, %-encoded if it has a query
        s3             an s3:// URL, %-encoded if it has a query (the coldest tier: hits are copied into
                       LMDB and memory)
        mooncake       a mooncake:// URL, %-encoded if it has a query
        write          behind | through (default behind: a put returns once in memory and a background
                       thread writes the next tier; through: once in the next tier)
        behind_bytes   at most this many bytes wait to be written behind (default min(memory/2, 2GiB));
                       write=behind only
        behind_age     seconds a value may wait before it is dropped, kept in memory only (default 30);
                       write=behind only
        admit          1..1000: a value goes to the next tier only on its N-th use (default 1; above 1
                       needs write=behind)

Common rules: sizes are bytes or a number with a unit (512MiB, 4GiB, 100GB, 1.5G; k/M/G/T are powers of
1000, KiB/MiB/GiB/TiB of 1024); booleans are true/false (1/0, yes/no, on/off); an unknown option, an
option given twice or a `#` (write %23) is an error; a StoreConfigError says what to change."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import quote, unquote, urlencode, urlsplit

from .errors import StoreConfigError
from .eviction import policy_name
from .tiered_admission import write_options
from .url import StoreURL, parse_bool, parse_size, parse_url, redact_url

DEFAULT_MEMORY_CAPACITY = "4GiB"
DEFAULT_LMDB_CAPACITY = "16GiB"  # allocated on disk at open (x1.31): a default must stay modest
DEFAULT_REDIS_TIMEOUT = 2.0
DEFAULT_S3_TIMEOUT = 5.0
DEFAULT_S3_CAPACITY = "1TiB"
DEFAULT_S3_REGION = "us-east-1"
DEFAULT_MOONCAKE_PORT = 50051  # the master's RPC port
DEFAULT_MOONCAKE_SEGMENT = "1GiB"
DEFAULT_MOONCAKE_BUFFER = "128MiB"
DEFAULT_MOONCAKE_TIMEOUT = 5.0
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


def _auto_bool(option: str | None, name: str) -> bool | None:
    if option is None or option.lower() == "auto":
        return None
    return parse_bool(option, name)


def _evict(opts: dict[str, str], scheme: str, option: str = "evict") -> str:
    return policy_name(opts.get(option, "lru").strip().lower(), f"{scheme}:// {option}=")  # eviction.py's check


def _query(pairs: dict) -> str:
    shown = {k: ("auto" if v is None else str(v).lower() if isinstance(v, bool) else v) for k, v in pairs.items()}
    return urlencode(shown, safe="/:")


@dataclass(frozen=True)
class MemorySpec:
    """memory://?capacity=4GiB[&pinned=][&reserve=][&evict=]: one process's host memory."""

    scheme: ClassVar[str] = "memory"
    # Capabilities the connectors ask for instead of a tier's type (each spec answers all three):
    process_local: ClassVar[bool] = True  # lives in one process: nothing another process can see or share
    admit: ClassVar[int] = 1  # uses before a page goes behind the memory tier (tiered:// admit=)
    memory_front: ClassVar[None] = None  # the memory tier in front of a slower one, if any
    capacity: int
    pinned: bool | None = None
    reserve: bool | None = None
    evict: str = "lru"

    def url(self, redact: bool = True) -> str:
        options = dict(capacity=self.capacity, pinned=self.pinned, reserve=self.reserve, evict=self.evict)
        return f"memory://?{_query(options)}"


@dataclass(frozen=True)
class LMDBSpec:
    """lmdb:///abs/dir?capacity=100GiB[&evict=]: a disk tier."""

    scheme: ClassVar[str] = "lmdb"
    process_local: ClassVar[bool] = False
    admit: ClassVar[int] = 1
    memory_front: ClassVar[None] = None
    path: str
    capacity: int
    evict: str = "lru"

    def url(self, redact: bool = True) -> str:
        return f"lmdb://{quote(self.path)}?capacity={self.capacity}" + (
            "" if self.evict == "lru" else f"&evict={self.evict}"
        )


@dataclass(frozen=True)
class RedisSpec:
    """redis://[user:password@]host:port/db?namespace=&timeout=&capacity= (rediss:// TLS; +cluster: seeds)."""

    process_local: ClassVar[bool] = False
    admit: ClassVar[int] = 1
    memory_front: ClassVar[None] = None
    scheme: str
    hosts: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr, log or error
    namespace: str = "default"
    timeout: float = DEFAULT_REDIS_TIMEOUT
    capacity: int | None = None  # None: the servers' maxmemory
    tls: tuple[tuple[str, str], ...] = ()

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("+cluster")

    @property
    def where(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.hosts)

    def url(self, redact: bool = True) -> str:
        user = ""
        if self.username is not None or self.password is not None:
            user = quote(self.username or "", safe="")
            if self.password is not None:
                user += ":" + ("***" if redact else quote(self.password, safe=""))
            user += "@"
        options: dict[str, object] = {"namespace": self.namespace, "timeout": repr(self.timeout), **dict(self.tls)}
        if self.capacity is not None:
            options["capacity"] = self.capacity
        path = "" if self.cluster else str(self.db)
        return f"{self.scheme}://{user}{','.join(f'{h}:{p}' for h, p in self.hosts)}/{path}?{_query(options)}"


@dataclass(frozen=True)
class S3Spec:
    """s3://bucket/prefix?endpoint=&region=&namespace=&capacity=&timeout=: an object store bucket."""

    scheme: ClassVar[str] = "s3"
    process_local: ClassVar[bool] = False
    admit: ClassVar[int] = 1
    memory_front: ClassVar[None] = None
    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str = DEFAULT_S3_REGION
    namespace: str = "default"
    capacity: int = 1 << 40
    timeout: float = DEFAULT_S3_TIMEOUT

    def url(self, redact: bool = True) -> str:
        options: dict[str, object] = {}
        if self.endpoint:
            options["endpoint"] = self.endpoint
        options.update(region=self.region, namespace=self.namespace, capacity=self.capacity)
        options["timeout"] = repr(self.timeout)
        path = f"{self.bucket}/{quote(self.prefix)}" if self.prefix else self.bucket
        return f"s3://{path}?{_query(options)}"


@dataclass(frozen=True)
class MooncakeSpec:
    """mooncake://host:port?metadata=&protocol=&device=&local=&segment=&buffer=&namespace=&capacity=: a pool."""

    scheme: ClassVar[str] = "mooncake"
    process_local: ClassVar[bool] = False
    admit: ClassVar[int] = 1
    memory_front: ClassVar[None] = None
    host: str
    port: int = DEFAULT_MOONCAKE_PORT
    metadata: str = ""  # the parser's default: the master's own HTTP metadata server
    protocol: str = "tcp"
    device: str = ""
    local: str | None = None  # None: the address that reaches the master
    segment: int = 1 << 30
    buffer: int = 128 << 20
    namespace: str = "default"
    capacity: int | None = None  # None: segment
    timeout: float = DEFAULT_MOONCAKE_TIMEOUT

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, redact: bool = True) -> str:
        options: dict[str, object] = {"metadata": self.metadata, "protocol": self.protocol}
        if self.device:
            options["device"] = self.device
        if self.local:
            options["local"] = self.local
        options.update(segment=self.segment, buffer=self.buffer, namespace=self.namespace, timeout=repr(self.timeout))
        if self.capacity is not None:
            options["capacity"] = self.capacity
        return f"mooncake://{self.master}?{_query(options)}"


@dataclass(frozen=True)
class TieredSpec:
    """tiered://?memory=&lmdb=&lmdb_capacity=&lmdb_evict=&redis=&s3=&mooncake=&write=&behind_bytes=&behind_age=&admit=&evict=."""

    scheme: ClassVar[str] = "tiered"
    process_local: ClassVar[bool] = False  # its memory tier is per process, its slower tiers are shared
    memory: MemorySpec
    lmdb: LMDBSpec | None = None
    redis: RedisSpec | None = None
    write: str = "behind"
    behind_bytes: int | None = None  # None: min(memory/2, 2GiB)
    behind_age: float | None = None  # None: 30 s
    admit: int = 1
    s3: S3Spec | None = None
    mooncake: MooncakeSpec | None = None

    def url(self, redact: bool = True) -> str:
        m = self.memory
        options: dict[str, object] = dict(
            memory=m.capacity, pinned=m.pinned, reserve=m.reserve, evict=m.evict, write=self.write
        )
        if self.lmdb:
            options.update(lmdb=self.lmdb.path, lmdb_capacity=self.lmdb.capacity)
            if self.lmdb.evict != "lru":
                options["lmdb_evict"] = self.lmdb.evict
        if self.redis:
            options["redis"] = self.redis.url(redact=False)
        if self.s3:
            options["s3"] = self.s3.url(redact=False)
        if self.mooncake:
            options["mooncake"] = self.mooncake.url(redact=False)
        extra = dict(
            behind_bytes=self.behind_bytes,
            behind_age=self.behind_age and repr(self.behind_age),
            admit=self.admit if self.admit != 1 else None,
        )
        options.update({k: v for k, v in extra.items() if v is not None})
        url = f"tiered://?{_query(options)}"
        return redact_url(url) if redact else url

    @property
    def memory_front(self) -> MemorySpec:
        return self.memory

    def behind_options(self) -> dict:
        """The write-behind keywords TieredStore takes, only those given."""
        given = dict(behind_bytes=self.behind_bytes, behind_age=self.behind_age)
        if self.admit != 1:
            given["admit"] = self.admit
        return {k: v for k, v in given.items() if v is not None}


StoreSpec = MemorySpec | LMDBSpec | RedisSpec | S3Spec | MooncakeSpec | TieredSpec


def _memory(parsed: StoreURL, url: str) -> MemorySpec:
    opts = parsed.take({"capacity", "pinned", "reserve", "evict"})
    if parsed.path not in ("", "/"):
        raise StoreConfigError(f"memory:// takes no path, got {redact_url(parsed.path)!r} in {redact_url(url)!r}")
    return MemorySpec(
        parse_size(opts.get("capacity", DEFAULT_MEMORY_CAPACITY), "memory capacity"),
        _auto_bool(opts.get("pinned"), "pinned"),
        _auto_bool(opts.get("reserve"), "reserve"),
        _evict(opts, "memory"),
    )


def _lmdb(parsed: StoreURL, url: str) -> LMDBSpec:
    opts = parsed.take({"capacity", "evict"})
    if not parsed.path:
        raise StoreConfigError(
            f"lmdb:// needs an absolute directory, e.g. lmdb:///var/cache/kvoffload ({redact_url(url)!r})"
        )
    return LMDBSpec(
        parsed.path, parse_size(opts.get("capacity", DEFAULT_LMDB_CAPACITY), "lmdb capacity"), _evict(opts, "lmdb")
    )


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise StoreConfigError(f"redis timeout={text!r}: give the seconds a call may wait, a positive number such as 2")
    return value


def _redis(parsed: StoreURL, url: str) -> RedisSpec:
    opts = parsed.take({"capacity", "namespace", "timeout", *TLS_OPTIONS})
    shown = redact_url(url)
    parts = urlsplit(url)
    tls = tuple((k, opts[k]) for k in TLS_OPTIONS if k in opts)
    if parsed.scheme.startswith("rediss"):
        if dict(tls).get("ssl_cert_reqs", "required") not in ("required", "optional", "none"):
            raise StoreConfigError("ssl_cert_reqs must be required, optional or none")
    elif tls:
        raise StoreConfigError(f"{', '.join(k for k, _ in tls)}: TLS options need rediss:// (or rediss+cluster://)")
    hosts = [h for h in parts.netloc.rpartition("@")[2].split(",") if h]
    if not hosts:
        raise StoreConfigError(f"{shown}: name at least one host:port")
    try:
        nodes = tuple((h.rpartition(":")[0] or h, int(h.rpartition(":")[2]) if ":" in h else 6379) for h in hosts)
    except ValueError:
        raise StoreConfigError(f"{shown}: hosts are host:port") from None
    db = "0"
    if not parsed.scheme.endswith("+cluster"):
        if len(nodes) > 1:
            raise StoreConfigError(f"{shown}: several hosts need redis+cluster://")
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise StoreConfigError(f"{shown}: the path is a database number, got {db!r}")
    return RedisSpec(
        parsed.scheme,
        nodes,
        int(db),
        unquote(parts.username) if parts.username else None,
        unquote(parts.password) if parts.password else None,
        opts.get("namespace", "default"),
        _timeout(opts.get("timeout", str(DEFAULT_REDIS_TIMEOUT))),
        parse_size(opts["capacity"], "redis capacity") if opts.get("capacity") else None,
        tls,
    )


def _s3(parsed: StoreURL, url: str) -> S3Spec:
    opts = parsed.take({"endpoint", "region", "namespace", "capacity", "timeout"})
    shown = redact_url(url)
    netloc = urlsplit(url).netloc
    if "@" in netloc:
        raise StoreConfigError(
            f"{shown}: s3:// takes no credentials in the URL: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) in the environment"
        )
    bucket, _, prefix = parsed.path.partition("/")
    if not bucket:
        raise StoreConfigError(f"s3:// needs a bucket, e.g. s3://my-bucket/kv?endpoint=... ({shown!r})")
    endpoint = opts.get("endpoint") or None
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise StoreConfigError(f"s3:// endpoint= is a URL, http://host:port or https://host, got {endpoint[:60]!r}")
    try:
        timeout = _timeout(opts.get("timeout", str(DEFAULT_S3_TIMEOUT)))
    except StoreConfigError:
        raise StoreConfigError(
            f"s3 timeout={opts['timeout'][:40]!r}: give the seconds a request may take, a positive number such as 5"
        ) from None
    return S3Spec(
        bucket,
        prefix.strip("/"),
        endpoint.rstrip("/") if endpoint else None,
        opts.get("region") or DEFAULT_S3_REGION,
        opts.get("namespace", "default"),
        parse_size(opts.get("capacity", DEFAULT_S3_CAPACITY), "s3 capacity"),
        timeout,
    )


def _mooncake(parsed: StoreURL, url: str) -> MooncakeSpec:
    opts = parsed.take(
        {"metadata", "protocol", "device", "local", "segment", "buffer", "namespace", "capacity", "timeout"}
    )
    shown = redact_url(url)
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc or "," in netloc:
        raise StoreConfigError(f"{shown}: mooncake:// names one master, host:port (no user, no list)")
    host, _, port = netloc.rpartition(":") if ":" in netloc else (netloc, "", "")
    if not host:
        raise StoreConfigError(f"mooncake:// needs the master's address, e.g. mooncake://10.0.0.5:50051 ({shown!r})")
    if parts.path not in ("", "/"):
        raise StoreConfigError(f"mooncake:// takes no path, got {parts.path[:40]!r} in {shown!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise StoreConfigError(f"{shown}: the master's port is a number 1-65535, got {port[:12]!r}")
    protocol = opts.get("protocol", "tcp").lower()
    if protocol not in ("tcp", "rdma"):
        raise StoreConfigError(f"mooncake:// protocol= is tcp or rdma, got {opts['protocol'][:20]!r}")
    if opts.get("device") and protocol != "rdma":
        raise StoreConfigError("mooncake:// device= names RDMA devices: it needs protocol=rdma")
    metadata = opts.get("metadata") or f"http://{host}:8080/metadata"
    if not metadata.startswith(("http://", "https://", "etcd://", "redis://")):
        raise StoreConfigError(
            f"mooncake:// metadata= is the metadata server's URL (http://host:port/metadata), got {metadata[:60]!r}"
        )
    buffer = parse_size(opts.get("buffer", DEFAULT_MOONCAKE_BUFFER), "mooncake buffer")
    try:
        timeout = _timeout(opts.get("timeout", str(DEFAULT_MOONCAKE_TIMEOUT)))
    except StoreConfigError:
        raise StoreConfigError(
            f"mooncake timeout={opts['timeout'][:40]!r}: give the seconds a call may take, a positive number such as 5"
        ) from None
    given = opts.get("segment", DEFAULT_MOONCAKE_SEGMENT)
    segment = 0 if given.strip() == "0" else parse_size(given, "mooncake segment")  # 0: a client only
    if buffer < 1 << 20:
        raise StoreConfigError(f"mooncake:// buffer= is at least 1MiB (a value must fit in it), got {buffer}")
    return MooncakeSpec(
        host,
        int(port) if port else DEFAULT_MOONCAKE_PORT,
        metadata,
        protocol,
        opts.get("device", ""),
        opts.get("local") or None,
        segment,
        buffer,
        opts.get("namespace", "default"),
        parse_size(opts["capacity"], "mooncake capacity") if opts.get("capacity") else None,
        timeout,
    )


def _tiered(parsed: StoreURL, url: str) -> TieredSpec:
    opts = parsed.take(
        {
            "memory",
            "lmdb",
            "lmdb_capacity",
            "lmdb_evict",
            "pinned",
            "reserve",
            "redis",
            "s3",
            "mooncake",
            "write",
            "behind_bytes",
            "behind_age",
            "admit",
            "evict",
        }
    )
    shared = [name for name in ("redis", "s3", "mooncake") if name in opts]
    if "lmdb" not in opts and not shared:
        raise StoreConfigError(
            "tiered:// needs lmdb=/abs/dir and/or redis=<URL>, s3=<URL> or mooncake=<URL> (and optionally "
            f"memory=): {redact_url(url)!r}"
        )
    if len(shared) > 1:
        raise StoreConfigError(
            f"tiered:// takes one shared tier (redis=, s3= or mooncake=), not {' and '.join(shared)}: "
            f"{redact_url(url)!r}"
        )
    # write= and admit=: TieredStore's own check (tiered_admission.py), made here so a bad URL opens nothing
    write, admit = write_options(opts.get("write", "behind").lower(), opts.get("admit", "1"), "tiered://")
    if write == "through" and ({"behind_bytes", "behind_age"} & set(opts)):
        raise StoreConfigError(
            f"tiered:// behind_bytes= and behind_age= apply to write=behind only: {redact_url(url)!r}"
        )
    behind_bytes = parse_size(opts["behind_bytes"], "behind_bytes") if "behind_bytes" in opts else None
    behind_age = None
    if "behind_age" in opts:
        try:
            behind_age = float(opts["behind_age"])
        except ValueError:
            behind_age = math.nan
        if not 0 < behind_age < math.inf:
            raise StoreConfigError(
                f"tiered:// behind_age= takes a positive number of seconds, got {opts['behind_age'][:40]!r}"
            )
    redis = None
    if "redis" in opts:
        inner = parse_url(opts["redis"])
        if inner.scheme not in REDIS_SCHEMES:
            raise StoreConfigError(
                f"tiered:// redis= takes a redis://, rediss:// or redis+cluster:// URL: {redact_url(url)!r}"
            )
        redis = _redis(inner, opts["redis"])
    s3 = None
    if "s3" in opts:
        inner = parse_url(opts["s3"])
        if inner.scheme != "s3":
            raise StoreConfigError(f"tiered:// s3= takes an s3:// URL: {redact_url(url)!r}")
        s3 = _s3(inner, opts["s3"])
    mooncake = None
    if "mooncake" in opts:
        inner = parse_url(opts["mooncake"])
        if inner.scheme != "mooncake":
            raise StoreConfigError(f"tiered:// mooncake= takes a mooncake:// URL: {redact_url(url)!r}")
        mooncake = _mooncake(inner, opts["mooncake"])
    lmdb = None
    if "lmdb" in opts:
        lmdb = LMDBSpec(
            opts["lmdb"],
            parse_size(opts.get("lmdb_capacity", DEFAULT_LMDB_CAPACITY), "lmdb_capacity"),
            _evict(opts, "tiered", "lmdb_evict"),
        )
    elif "lmdb_evict" in opts:
        raise StoreConfigError(f"tiered:// lmdb_evict= needs lmdb=/abs/dir: {redact_url(url)!r}")
    memory = MemorySpec(
        parse_size(opts.get("memory", DEFAULT_MEMORY_CAPACITY), "memory capacity"),
        _auto_bool(opts.get("pinned"), "pinned"),
        _auto_bool(opts.get("reserve"), "reserve"),
        _evict(opts, "tiered"),
    )
    return TieredSpec(memory, lmdb, redis, write, behind_bytes, behind_age, admit, s3, mooncake)


# scheme -> parser; the openers are in kvoffload.store (open_spec), next to the store classes.
PARSERS: dict[str, Callable[[StoreURL, str], StoreSpec]] = {
    "memory": _memory,
    "lmdb": _lmdb,
    **{s: _redis for s in REDIS_SCHEMES},
    "s3": _s3,
    "mooncake": _mooncake,
    "tiered": _tiered,
}


def parse_store_url(url: str) -> StoreSpec:
    """The spec a store URL names, validated: a StoreConfigError says what to change."""
    parsed = parse_url(url)
    parser = PARSERS.get(parsed.scheme)
    if parser is None:
        raise StoreConfigError(
            f"unknown store scheme {parsed.scheme!r} in {redact_url(url)!r}: use memory://, "
            "lmdb://, redis:// (rediss://, redis+cluster://), s3://, mooncake:// or tiered://"
        )
    return parser(parsed, url)
