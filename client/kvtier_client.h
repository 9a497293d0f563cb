// libkvtier: the client of kvtierd. Connects over the daemon's Unix socket
// (and then moves chunk bytes through the daemon's shared-memory pool) or over
// TCP with a bearer token (bytes inline). Computes chunk keys from token ids,
// finds the longest cached prefix, stores and loads chunks from/to host
// buffers, synchronously, asynchronously (std::future completion handles) or
// in batches.
//
// Thread-safe: one client may be used from many threads at once. The pool
// mapping lives as long as the client.
#ifndef KVTIER_CLIENT_KVTIER_CLIENT_H_
#define KVTIER_CLIENT_KVTIER_CLIENT_H_

#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/chunk.h"
#include "common/hash.h"

namespace kvtier::client {

enum class Tier : uint8_t { kUnknown = 0, kHbm, kDram, kNvme, kRemote };
const char* TierName(Tier t);  // "hbm", "dram", "nvme", "remote", "unknown"

// Reads a bearer token file (what --token-file and token_file name): the
// token is the file's text without leading and trailing whitespace.
// NotFound if the file cannot be opened; InvalidArgument if it is not a
// regular file, is larger than 4 KiB, holds no token, or the token holds
// whitespace or control characters (a token travels in an HTTP header).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The daemon's default socket, relative to the working directory.
inline constexpr char kDefaultSocket[] = "./kvtier-data/kvtierd.sock";

struct ClientOptions {
  // Unix socket of the daemon. Default: kDefaultSocket
  std::string socket_path = kDefaultSocket;
  // TCP "HOST:PORT"; when set it is used instead of the socket and chunk
  // bytes travel inline. Default: "" (Unix socket)
  std::string tcp_addr;
  // Bearer token sent on every call (required by the daemon on TCP).
  // Default: ""
  std::string token;
  // PEM CA bundle the daemon's TLS certificate must chain to; with it the
  // TCP connection uses TLS (the daemon's --tls-cert). TCP only.
  // Default: "" (plaintext)
  std::string tls_ca;
  // PEM client certificate chain and private key presented to a daemon
  // that asks for one (--tls-client-ca). Need tls_ca. Default: "" (none)
  std::string tls_cert;
  std::string tls_key;
  // Name the daemon's certificate is checked against instead of tcp_addr's
  // host. Default: "" (the host of tcp_addr)
  std::string tls_server_name;
  // Map the daemon's pool and move chunk bytes through it (Unix socket
  // only; falls back to inline bytes if the daemon has no pool).
  // Default: true
  bool shared_memory = true;
  // Pre-fault the whole pool mapping at Connect (MAP_POPULATE), so chunk
  // copies do not page-fault; costs time at Connect for a large pool.
  // Default: true
  bool populate_mapping = true;
  // Most connections to the daemon's shared-memory data plane (one per
  // call in flight: put, get, hold, unhold, lookup, plan, batch, prefetch go
  // over them as small binary frames instead of gRPC calls). Calls beyond
  // them, and every call when the daemon does not serve the data plane, use
  // gRPC. 0 = gRPC only. Default: 4
  int max_data_connections = 4;
  // A get through shared memory hashes the bytes it copies on a helper
  // thread the client owns, a piece behind the copy, instead of after each
  // piece on the copying thread; the copy itself stays on the caller's
  // thread, and the caller takes over what the helper has not hashed when
  // the copy ends (all of it, if the helper is not running), so a busy
  // machine costs little more than hashing on the caller's thread.
  // Default: true
  bool check_on_helper_thread = true;
  // Deadline of each call. Default: 60000
  int64_t timeout_ms = 60000;
  // Largest message each way, MiB. Default: 64
  int max_message_mib = 64;
};

struct PutOptions {
  // Return only once the chunk is committed on the daemon's NVMe tier (data
  // synced, index committed), so it survives a crash or kill -9 of the
  // daemon. It is still a cache entry: the daemon evicts it under capacity
  // pressure and deletes it like any other chunk (docs/daemon.md, "Durable
  // puts"). FailedPrecondition from a daemon without an NVMe tier.
  // Default: false
  bool durable = false;
  // CommitSlot only: the slot's chunk has every byte but its checksums (a
  // GPU store's kernel wrote it); the daemon computes them, so the chunk is
  // hashed once, on the daemon's threads. Default: false
  bool daemon_seals = false;
  // CommitSlot with daemon_seals, through the shared-memory data plane only:
  // the chunk is still landing in the slot, in groups of this many layers, as
  // wire::LandingMarker says (a GPU store's copies), and the daemon hashes
  // each record as it lands. DeadlineExceeded (the records did not land in
  // wire::shm::kLandingWaitMs) and every other error before the seal leave
  // the slot the caller's, to commit again or abort once its writes are
  // done; Unimplemented over gRPC; InvalidArgument from a daemon that
  // predates it. 0 (default): every byte is in the slot.
  uint32_t landing_layers = 0;
};

struct PrefixHit {
  std::vector<Hash128> keys;  // key of every full chunk of the tokens
  std::vector<Tier> tiers;    // fastest tier of each cached chunk of the prefix
  size_t cached_chunks() const { return tiers.size(); }
};

// A cached prefix with what loading it would cost (KvtierClient::PlanLoad).
struct LoadPlan {
  std::vector<Tier> tiers;            // fastest tier of each hit, as Lookup
  std::vector<uint64_t> chunk_bytes;  // each hit's size
  std::vector<double> load_us;        // each hit's estimated load time
  // With a prefill rate: the leading hits worth loading rather than
  // recomputing (0..tiers.size()), their estimated load time, and the
  // recompute time loading them saves.
  size_t load_chunks = 0;
  double load_chunks_us = 0;
  double saved_us = 0;
};

// A load plan whose chunks to load are held until ReleasePlan or the lease
// expires (KvtierClient::LookupAndHold): nothing in plan.load_chunks is
// evicted, moved or deleted meanwhile.
struct HeldPlan {
  LoadPlan plan;          // plan.load_chunks: the leading hits held
  uint64_t lease_id = 0;  // 0: nothing held
  int64_t expires_at_us = 0;  // on the daemon's clock
  // Which data-plane connection holds the lease (0: gRPC); the daemon ends
  // the hold when that connection closes.
  uint64_t connection = 0;
};

// What KvtierClient::PrefetchWithin queued.
struct PrefetchResult {
  bool completed = false;  // the queued chunks reached DRAM within the wait
  uint32_t keys = 0;       // chunks queued (the leading ones within the budget)
  uint64_t bytes = 0;      // their bytes
};

// Most keys one batch call (HoldBatch, GetBatchInto, PutBatch over the data
// plane) carries in one frame.
inline constexpr size_t kMaxBatchKeys = 1024;

struct TierStats {
  Tier tier = Tier::kUnknown;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t chunks = 0;
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
};
struct DaemonStats {
  std::vector<TierStats> tiers;
  std::vector<std::pair<std::string, uint64_t>> counters;
};

// A slot of the daemon's pool reserved for one chunk; write the chunk into
// `data` (e.g. from a GPU kernel through the mapping), then CommitSlot. The
// daemon verifies the bytes once, at commit. After CommitSlot or AbortSlot
// the slot is no longer the client's: a later write through `data` corrupts
// a stored chunk, which the next reader detects (DataLoss, chunk dropped).
struct WritableSlot {
  uint64_t id = 0;
  std::span<uint8_t> data;
  // The data-plane connection that allocated it, which commits or aborts it
  // (its serial); 0 for a slot allocated over gRPC.
  uint64_t connection = 0;
};

// A chunk read in place in the daemon's pool (zero-copy), held until Unhold:
// either the chunk itself is pinned (lease_id) or the daemon copied it into a
// scratch slot (scratch_slot_id). The daemon verified the bytes at put; Hold
// with `verify` makes it check them again before answering.
struct HeldChunk {
  std::span<const uint8_t> data;
  Tier tier = Tier::kUnknown;
  uint64_t lease_id = 0;
  uint64_t scratch_slot_id = 0;
  // The daemon checked these bytes against their checksums as this hold read
  // them (a chunk its NVMe or remote tier checked as it read it into a
  // scratch slot, or a hold that asked for the check): the reader's check
  // (wire::VerifyChunkParallel) is not due again. False for a stored DRAM
  // chunk handed out in place, which the reader checks.
  bool checked = false;
  // Which of the client's data-plane connections took the hold (0: gRPC).
  // The daemon ends a hold taken on a data-plane connection only when that
  // connection asks (or closes), so Unhold goes back over it.
  uint64_t connection = 0;
};

// The reader's check of a held chunk's bytes (wire::VerifyChunkParallel):
// OK at once when the daemon checked them as the hold read them
// (HeldChunk::checked), else OK or DataLoss.
absl::Status CheckHeldBytes(const HeldChunk& held);

// The header of chunk bytes the daemon handed out (held in its pool or
// copied from it). It verified them at put, so a header that does not parse
// or a length that is not the header's is corruption after the put:
// DataLoss naming what failed, never InvalidArgument, so that the reader
// asks the daemon to check (and drop) the stored chunk.
absl::StatusOr<codec::ChunkHeader> ParseStoredHeader(std::span<const uint8_t> bytes);

class KvtierClient {
 public:
  // Connects and checks the daemon answers (Health). Unavailable if it does
  // not; with shared memory on a Unix socket, maps the pool
  // (FailedPrecondition if that fails).
  static absl::StatusOr<std::unique_ptr<KvtierClient>> Connect(const ClientOptions& options);
  virtual ~KvtierClient() = default;

  // True if chunk bytes move through the mapped pool.
  virtual bool uses_shared_memory() const = 0;
  // True if shared-memory gets hash on a helper thread
  // (ClientOptions::check_on_helper_thread, where it applies).
  virtual bool checks_on_helper_thread() const = 0;

  // Chunk keys of `tokens` (codec::ChunkKeys over full chunks).
  static absl::StatusOr<std::vector<Hash128>> ChunkKeys(const Hash128& fingerprint,
                                                        std::span<const uint32_t> tokens,
                                                        uint32_t chunk_tokens = 256);

  // Fastest tier of each key of the longest cached prefix of `keys`.
  virtual absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) = 0;
  // Lookup with each hit's size and estimated load time (the daemon's
  // measured tier bandwidths, or its assumed ones before it has measured);
  // with `prefill_tokens_per_s` > 0 (the engine's prefill throughput) and
  // `tokens_per_chunk`, also how many leading hits are worth loading rather
  // than recomputing. `attention_doubling_tokens` > 0 (C2, the context
  // length at which a token's prefill costs twice its short-context cost;
  // the rate is then the short-context one) makes the later chunks of a
  // long prefix cost more to recompute; 0 keeps that cost linear in tokens
  // (bandwidth::RecomputeMicros, docs/daemon.md "Load or recompute").
  // InvalidArgument for a negative or non-finite rate or
  // attention_doubling_tokens, or tokens_per_chunk outside 1..1048576 with a
  // rate. A daemon older than attention_doubling_tokens ignores it over
  // gRPC and refuses it over the data plane (InvalidArgument).
  virtual absl::StatusOr<LoadPlan> PlanLoad(std::span<const Hash128> keys,
                                            double prefill_tokens_per_s = 0,
                                            uint32_t tokens_per_chunk = 256,
                                            double attention_doubling_tokens = 0) = 0;
  // PlanLoad that also holds the chunks the plan says to load (every hit
  // without a rate) under one lease of `lease_ms` (0: the daemon's default),
  // in one round trip over the data plane (gRPC PlanLoad and Pin
  // otherwise). A client that closes or dies releases its holds at once.
  // ResourceExhausted (nothing held) when the daemon's held-bytes limit
  // (kvtierd --max-held-share) would be passed.
  virtual absl::StatusOr<HeldPlan> LookupAndHold(std::span<const Hash128> keys,
                                                 double prefill_tokens_per_s = 0,
                                                 uint32_t tokens_per_chunk = 256,
                                                 uint32_t lease_ms = 0,
                                                 double attention_doubling_tokens = 0) {
    return absl::UnimplementedError("LookupAndHold");
  }
  // Ends the hold of a plan. NotFound if it expired or was released.
  virtual absl::Status ReleasePlan(const HeldPlan& plan) {
    return absl::UnimplementedError("ReleasePlan");
  }
  // Keys of the tokens and how many leading chunks are cached.
  absl::StatusOr<PrefixHit> LongestCachedPrefix(const Hash128& fingerprint,
                                                std::span<const uint32_t> tokens,
                                                uint32_t chunk_tokens = 256);

  // Stores a chunk (the daemon verifies it: InvalidArgument / DataLoss for
  // bad bytes). Through a slot with shared memory, inline otherwise.
  virtual absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                           const PutOptions& options = {}) = 0;
  // Shared memory only (FailedPrecondition otherwise).
  virtual absl::StatusOr<WritableSlot> AllocateSlot(uint64_t bytes) = 0;
  virtual absl::Status CommitSlot(const WritableSlot& slot, const Hash128& key,
                                  const PutOptions& options = {}) = 0;
  virtual absl::Status AbortSlot(const WritableSlot& slot) = 0;

  // The chunk's bytes. NotFound on a miss, DataLoss if the chunk is corrupt.
  // Through shared memory the client checks the checksums of the bytes it
  // copies, in the same pass as the copy; on a mismatch it asks the daemon to
  // verify the stored chunk, which drops it (DataLoss). The lease the get
  // held is released without waiting for the daemon's answer: until it
  // arrives (an RPC's time) another client may find the chunk pinned; this
  // client's own calls that could see the pin (Put, Delete, Pin, Release,
  // Prefetch, Stats, slot calls) wait for it first.
  virtual absl::StatusOr<std::vector<uint8_t>> Get(const Hash128& key) = 0;
  // Get, and the tier the chunk came from (kUnknown where the client cannot
  // tell).
  virtual absl::StatusOr<std::pair<std::vector<uint8_t>, Tier>> GetWithTier(const Hash128& key) {
    auto bytes = Get(key);
    if (!bytes.ok()) return bytes.status();
    return std::make_pair(*std::move(bytes), Tier::kUnknown);
  }
  // Copies the chunk into `out` and returns its length and tier.
  // InvalidArgument if `out` is too small.
  virtual absl::StatusOr<std::pair<uint64_t, Tier>> GetInto(const Hash128& key,
                                                            std::span<uint8_t> out) = 0;

  // Shared memory only (FailedPrecondition otherwise): the chunk's bytes in
  // the pool, valid until Unhold (or until the hold's lease expires).
  // NotFound on a miss; DataLoss when `verify` finds the chunk corrupt.
  virtual absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify = false) = 0;
  virtual absl::Status Unhold(const HeldChunk& chunk) = 0;
  // Unhold of a chunk whose bytes are no longer read, without waiting for
  // the daemon's answer where the path can (the data plane reads it at the
  // connection's next use; an error there means the lease had expired,
  // which ends the hold just the same).
  virtual absl::Status UnholdNoWait(const HeldChunk& chunk) { return Unhold(chunk); }
  // Hold of every key in one data-plane call (Hold per key without one):
  // one result per key in order, a miss being that key's NotFound. The
  // chunks on NVMe are read with one submission to the daemon's io_uring
  // queue. InvalidArgument for the whole batch for more than kMaxBatchKeys
  // keys or a key that appears twice.
  virtual absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(
      std::span<const Hash128> keys, bool verify = false) {
    return absl::UnimplementedError("HoldBatch");
  }
  // Unhold of every chunk, one data-plane call per connection that holds
  // some. The first error, if any (every hold is still ended).
  virtual absl::Status UnholdBatch(std::span<const HeldChunk> chunks) {
    absl::Status first;
    for (const HeldChunk& c : chunks) {
      absl::Status st = Unhold(c);
      if (first.ok()) first = st;
    }
    return first;
  }
  // GetInto of every key: the keys go in up to four groups, each a
  // HoldBatch, with up to two groups read by the daemon while the caller's
  // thread copies the one before them into its buffers, checking each chunk
  // in the same pass (a mismatch is retried as GetInto does); each group is
  // unheld once copied. One result per key: its length and tier, or
  // NotFound, DataLoss, InvalidArgument (buffer too small).
  std::vector<absl::StatusOr<std::pair<uint64_t, Tier>>> GetBatchInto(
      std::span<const Hash128> keys, std::span<const std::span<uint8_t>> outs);
  // The client's read-write mapping of the whole pool (empty without shared
  // memory): for registering it with a device (cudaHostRegister).
  virtual std::span<uint8_t> mapped_pool() const = 0;

  virtual absl::Status Delete(const Hash128& key) = 0;
  // True if every present key reached DRAM within `deadline_ms`.
  virtual absl::StatusOr<bool> Prefetch(std::span<const Hash128> keys, uint32_t deadline_ms) = 0;
  // Moves the leading chunks of the cached prefix of `keys` that are on
  // NVMe or remote only into DRAM, as many as fit in `byte_budget` bytes
  // (0: no limit), waiting up to `deadline_ms` (0: not at all). For an
  // engine to call when it admits a request, ahead of the load. Over the
  // data plane; over gRPC only without a budget (FailedPrecondition).
  virtual absl::StatusOr<PrefetchResult> PrefetchWithin(std::span<const Hash128> keys,
                                                        uint64_t byte_budget,
                                                        uint32_t deadline_ms) {
    return absl::UnimplementedError("PrefetchWithin");
  }
  // Returns the lease id; the pins end at Release or after `ttl_ms`.
  virtual absl::StatusOr<uint64_t> Pin(std::span<const Hash128> keys, uint32_t ttl_ms) = 0;
  virtual absl::Status Release(uint64_t lease_id) = 0;
  virtual absl::StatusOr<DaemonStats> Stats() = 0;

  // Asynchronous forms; the future is the completion handle. REQUIRES: the
  // memory behind `chunk` stays valid until the future is ready.
  std::future<absl::Status> PutAsync(const Hash128& key, std::span<const uint8_t> chunk,
                                     const PutOptions& options = {});
  std::future<absl::StatusOr<std::vector<uint8_t>>> GetAsync(const Hash128& key);
  std::future<absl::StatusOr<std::vector<Tier>>> LookupAsync(std::vector<Hash128> keys);

  // Batches: one status per key, in order. Through shared memory with a
  // data-plane connection free, a batch of at most kMaxBatchKeys distinct
  // keys is one call each way (PutBatch: the slots allocated at once, the
  // chunks copied, then one commit whose every chunk the daemon verifies;
  // GetBatch: GetBatchInto); otherwise every key is in flight at once on
  // its own call.
  std::vector<absl::Status> PutBatch(std::span<const Hash128> keys,
                                     std::span<const std::span<const uint8_t>> chunks,
                                     const PutOptions& options = {});
  std::vector<absl::StatusOr<std::vector<uint8_t>>> GetBatch(std::span<const Hash128> keys);

  // PutBatch in one data-plane exchange, as PutBatch describes.
  // FailedPrecondition when it cannot be done that way (no data plane, too
  // many or repeated keys), with nothing stored.
  virtual absl::StatusOr<std::vector<absl::Status>> PutBatchShared(
      std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
      const PutOptions& options = {}) {
    return absl::FailedPreconditionError("no data plane");
  }

 protected:
  // Copies `src` (a held chunk) into `dst` (at least as large) and checks
  // the checksums of what it copied in the same pass (wire::CopyVerified):
  // OK, or DataLoss. GetBatchInto and GetBatch copy with it; a client with a
  // helper thread overrides it to hash on that thread.
  virtual absl::Status CopyHeldChunk(std::span<uint8_t> dst, std::span<const uint8_t> src);

 private:
  // What GetBatchInto and GetBatch do to a group of `keys`: hold keys
  // [first, first + count), unhold, copy a held chunk (CopyHeldChunk).
  struct HeldGroupOps {
    KvtierClient* client;
    std::span<const Hash128> keys;
    absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> hold(size_t first, size_t count) const;
    absl::Status unhold(std::span<const HeldChunk> chunks) const;
    // Copies the held chunk into `dst` and checks it (CopyHeldChunk), or only
    // copies it when the daemon checked it as the hold read it.
    absl::Status copy(std::span<uint8_t> dst, const HeldChunk& held) const;
  };
  HeldGroupOps GroupOps(std::span<const Hash128> keys);
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_KVTIER_CLIENT_H_
