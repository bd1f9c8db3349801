"""Redis key, stream, group and channel names. One place, so every process agrees."""

PREFIX = "kaiten"

ENGINE_GROUP = "engines"                        # the consumer group of every request stream
DEAD_LETTER_STREAM = f"{PREFIX}:requests:dead"  # malformed or undeliverable entries
ABORT_STREAM = f"{PREFIX}:aborts"               # every engine XREADs all aborts (no group)
ABORT_STREAM_MAXLEN = 10_000
DEAD_LETTER_MAXLEN = 10_000
CONTROL_STREAM_MAXLEN = 1_000


def request_stream(model: str) -> str:
    """One model's shared request stream: gateways XADD the requests for `model` (its served name,
    as its engines announce it); only that model's engines XREADGROUP it (group ENGINE_GROUP)."""
    return f"{PREFIX}:model-requests:{model}"


def control_stream(model: str) -> str:
    """One model's control messages (``shared.protocol.Control``: load or unload a LoRA adapter).
    Every engine of the model XREADs all of it from the start (no group), so one that starts later
    replays the adapters loaded at run time; trimmed to about CONTROL_STREAM_MAXLEN entries."""
    return f"{PREFIX}:model-control:{model}"


def engine_stream(engine_id: str) -> str:
    """One engine's own request stream (cache-aware routing). Read by that engine first, in the
    consumer group ENGINE_GROUP; a dead engine's is emptied by the others' janitors and deleted."""
    return f"{PREFIX}:engine-requests:{engine_id}"


ENGINE_STREAM_PATTERN = f"{PREFIX}:engine-requests:*"


def blocks_key(engine_id: str) -> str:
    """Key (same TTL as the heartbeat) holding the prefix-cache block hashes one engine holds:
    packed little-endian uint64s (``shared.block_hash``), rewritten when they change."""
    return f"{PREFIX}:engine-blocks:{engine_id}"


# Field name of the msgpack payload inside a stream entry.
PAYLOAD_FIELD = b"m"


def reply_channel(gateway_id: str) -> str:
    """Pub/sub channel on which one gateway process receives the tokens of its requests."""
    return f"{PREFIX}:replies:{gateway_id}"


def heartbeat_key(engine_id: str) -> str:
    """Key (with a TTL) holding one engine's msgpack heartbeat."""
    return f"{PREFIX}:engine:{engine_id}"


HEARTBEAT_PATTERN = f"{PREFIX}:engine:*"


def gateway_alive_key(gateway_id: str) -> str:
    """Key (with a TTL, refreshed by the gateway) that says one gateway process is alive. An engine
    aborts the requests whose gateway's key is gone: nobody is waiting for their tokens."""
    return f"{PREFIX}:gateway:{gateway_id}"


GATEWAY_ALIVE_TTL_S = 1.5        # a gateway refreshes its key every GATEWAY_ALIVE_TTL_S / 3 seconds


def starting_key(instance: str) -> str:
    """Key (with a short TTL, refreshed) holding a starting engine's msgpack
    ``shared.startup_stages.StartupState`` until it serves; its last state (stage "serving")
    expires on its own."""
    return f"{PREFIX}:engine-starting:{instance}"


STARTING_PATTERN = f"{PREFIX}:engine-starting:*"
STARTING_TTL_S = 5.0             # a starting engine refreshes its key every second
