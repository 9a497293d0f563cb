// libkvtier's GPU paged-cache path (built only with CUDA): stores a chunk
// from an engine's paged KV cache straight into a slot of kvtierd's
// shared-memory pool, and loads one from the pool into the paged cache,
// without staging copies on the host.
//
//   Store: AllocateSlot -> kernels::GatherEncode into a device staging
//          buffer (HBM speed: the kernels hold the SMs for microseconds, not
//          for the PCIe transfer) -> one copy-engine cudaMemcpyAsync of the
//          chunk into the slot (registered with cudaHostRegister) ->
//          CommitSlot, unsealed: the daemon computes the checksums as it
//          commits. Without device memory for the staging buffer the
//          kernels write the slot through the pool mapping instead.
//          Landing (GpuPagedIo::landing_layers): the copy goes in groups of
//          layers, each followed by its wire::LandingMarker, and the commit
//          is sent once the header has landed, so the daemon hashes each
//          group as it lands.
//          A PendingStore splits the encode by layer ranges, so that a
//          prefill can encode layer l while it computes layer l + 1.
//   Load:  Hold (the chunk's extent, pinned) -> the header and both section
//          checksums are checked on the host (the reader's check; the daemon
//          verified at put) while kernels::DecodeScatter decodes the extent
//          (a copy-engine copy into a kernels::HostStaging, the decode from
//          there) -> the stream is synchronized -> Unhold.
//          A LayerwiseLoad holds and checks many chunks at once, then
//          enqueues their decode layer group by layer group with a CUDA
//          event per group, so that attention of layer l waits for layer l
//          only; these decodes read the extents over the mapping (a layer
//          group's records are too small for a copy to pay), each launch
//          after the first chained to the one before it
//          (kernels::PriorKernel::kLeavesChunk: it loads its part of the
//          extent while the previous decode finishes).
//
// Thread-safe: any number of Store, Load and BeginStore / BeginLayerwiseLoad
// calls may run at once (each launch of GatherEncode gets its own workspace,
// each Load its own staging buffer, from pools; a staging buffer is as large
// as the largest chunk it loaded). A PendingStore or LayerwiseLoad is used
// by one thread at a time. The client must outlive this object and keep its
// pool mapping (it does for its lifetime); PendingStore and LayerwiseLoad
// objects must not outlive the GpuPagedIo that made them.
#ifndef KVTIER_CLIENT_KVTIER_GPU_H_
#define KVTIER_CLIENT_KVTIER_GPU_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <vector>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/kvtier_client.h"
#include "codec/chunk.h"
#include "common/hash.h"
#include "common/worker_pool.h"
#include "kernels/paged_codec.h"
#include "kernels/paged_layout.h"

namespace kvtier::client {

class GpuPagedIo;

// A chunk being encoded into a slot of the daemon's pool, layer range by
// layer range (GpuPagedIo::BeginStore). Destroyed without a successful
// Commit, it waits for its launches and aborts the slot.
class PendingStore {
 public:
  ~PendingStore();
  PendingStore(const PendingStore&) = delete;
  PendingStore& operator=(const PendingStore&) = delete;

  // Enqueues the encode of `layers` of the spec's tokens at `blocks` of
  // `cache` on `stream` (asynchronous, no host synchronization), into the
  // staging buffer, and after the last layer the copy of the chunk into the
  // slot. Ranges come in order and without gaps: the first starts
  // at layer 0, each next one where the previous ended; all on one stream
  // (or on streams the caller orders). InvalidArgument for a range out of
  // that order or a cache/blocks mismatch (nothing is launched);
  // FailedPrecondition after Commit or a failed launch.
  absl::Status EncodeLayers(const kernels::PagedKvLayout& cache, const kernels::BlockSpan& blocks,
                            kernels::LayerRange layers, cudaStream_t stream);

  // The layers encoded so far: [0, encoded_layers()).
  uint32_t encoded_layers() const { return next_layer_; }

  // Waits for the encodes and the copy into the slot, and gives the device
  // buffers back: after it the chunk's blocks may be reused and Commit
  // makes no CUDA call. FailedPrecondition unless every layer was encoded;
  // a CUDA error otherwise (the store is then broken). Idempotent.
  absl::Status WaitEncoded();

  // Commits the chunk as `key`, unsealed: the daemon computes its checksums
  // as it commits (PutOptions::daemon_seals), in its one pass over the
  // chunk, spread over its worker pool. Where the copy into the slot went in
  // landing pieces (GpuPagedIo::landing_layers) and is still running, the
  // commit is sent once the header has landed and the daemon hashes each
  // piece as it lands (PutOptions::landing_layers), so the commit ends about
  // one piece's hash after the copy; otherwise (or if that commit fails
  // before the seal, e.g. a daemon without it) it follows WaitEncoded.
  // Returns after WaitEncoded either way. FailedPrecondition unless every
  // layer was encoded; the daemon's codes otherwise. The slot is aborted on
  // any error.
  absl::Status Commit(const Hash128& key, const PutOptions& options = {});

 private:
  friend class GpuPagedIo;
  PendingStore(GpuPagedIo* io, const codec::ChunkSpec& spec, const codec::ChunkLayout& layout,
               WritableSlot slot, uint32_t* workspace,
               std::unique_ptr<kernels::HostStaging> staging);
  // Enqueues the copy of the staged chunk into the slot on `stream`: the
  // header, header_landed_, then the records of each section in groups of
  // landing_layers_ layers, each group followed by its wire::LandingMarker
  // (the record tables are the daemon's to write). InvalidArgument (nothing
  // enqueued) for a layout it cannot split; CUDA errors otherwise.
  absl::Status EnqueueLandingCopy(cudaStream_t stream);
  // Commit's landing path: OK once the daemon sealed and stored the chunk;
  // otherwise the error, with the slot still this store's.
  absl::Status CommitLanding(const Hash128& key, const PutOptions& options);
  // Where the kernels write the chunk: the device staging buffer, or the
  // slot through the pool's mapping.
  uint8_t* EncodeTarget() const;
  // Waits (the thread sleeps) for done_. REQUIRES: done_ != nullptr.
  absl::Status WaitDone() const;

  GpuPagedIo* const io_;
  const codec::ChunkSpec spec_;
  const codec::ChunkLayout layout_;
  const WritableSlot slot_;
  uint32_t* workspace_;  // returned to io_'s pool once the encodes are done
  // Device memory the kernels encode into, copied to the slot by the copy
  // engine after the last layer; null: the kernels write the slot itself.
  std::unique_ptr<kernels::HostStaging> staging_;
  cudaStream_t stream_ = nullptr;  // of the last EncodeLayers
  cudaEvent_t done_ = nullptr;     // recorded after the last layer's launches
  absl::Time done_expected_;      // when done_ should complete, if the stream was idle
  // Landing copies (EnqueueLandingCopy): the layers per group, and the event
  // recorded once the header is in the slot; 0 and null otherwise.
  uint32_t landing_layers_ = 0;
  cudaEvent_t header_landed_ = nullptr;
  // Whether the copy may land in groups: not for StoreBatch, whose commits
  // follow WaitEncoded (one copy moves a chunk faster than groups).
  bool may_land_ = true;
  uint32_t next_layer_ = 0;
  bool encoded_ = false;    // WaitEncoded succeeded: no device work left
  bool slot_gone_ = false;  // committed or aborted
  bool broken_ = false;     // a launch or the wait for it failed
};

// A chunk of a batch (StoreBatch, BeginLayerwiseLoad): its key and the
// blocks of its tokens.
struct PagedChunk {
  Hash128 key;
  kernels::BlockSpan blocks;
};

// A batch of chunks decoded layer group by layer group
// (GpuPagedIo::BeginLayerwiseLoad). Every decode is enqueued when the object
// is returned; layer group g (layers [g * layer_group, (g + 1) *
// layer_group)) of every found chunk is in the cache once event(g) has
// completed. The chunks stay held in the daemon until Finish (those of
// earlier rounds, when the hold limit made BeginLayerwiseLoad run in rounds,
// until their round ended).
class LayerwiseLoad {
 public:
  // Finishes (waits for the last decode and unholds) if Finish was not called.
  ~LayerwiseLoad();
  LayerwiseLoad(const LayerwiseLoad&) = delete;
  LayerwiseLoad& operator=(const LayerwiseLoad&) = delete;

  uint32_t num_layers() const { return num_layers_; }
  uint32_t layer_group() const { return layer_group_; }
  // The event recorded after the decodes of the group that holds `layer`.
  // REQUIRES: layer < num_layers().
  cudaEvent_t LayerEvent(uint32_t layer) const { return events_[layer / layer_group_]; }

  // Makes `stream` wait (on the device, cudaStreamWaitEvent) until `layer`
  // of every found chunk is in the cache. Does not block the host; valid
  // inside stream capture. InvalidArgument for a layer out of range.
  absl::Status WaitLayer(uint32_t layer, cudaStream_t stream) const;

  // What each chunk's load gave, in the order of the request: its tier, or
  // NotFound (miss), DataLoss (corrupt; the daemon drops it) and the like.
  // Final only after Finish: the layer records of every held chunk are
  // checked while or after the kernels decode them (only the header is
  // checked before the launch), so a chunk whose bytes fail that check has
  // been decoded and its slots hold what was read; it is reported DataLoss
  // here and its slots must not be used. A chunk that failed before its
  // launch (a miss, a bad header) was not decoded and its slots are
  // untouched.
  const std::vector<absl::StatusOr<Tier>>& results() const { return results_; }

  // Blocks until every chunk is checked and every decode has finished, then
  // ends the holds. Returns the first CUDA or unhold error (results() stays
  // as it was); OK otherwise. Idempotent.
  absl::Status Finish();

 private:
  friend class GpuPagedIo;
  LayerwiseLoad(GpuPagedIo* io, KvtierClient* client, uint32_t num_layers, uint32_t layer_group)
      : io_(io), client_(client), num_layers_(num_layers), layer_group_(layer_group) {}

  // Hashes the sections of held chunks until none is left (a verifier
  // thread's loop); records DataLoss in results_ for a chunk that fails.
  void VerifyHeld();

  // The staged form (GpuPagedIo::BeginLayerwiseLoad): the chunks' records
  // go a span of layer groups at a time, in slabs of several chunks, through
  // two device buffers by a copy stream, and each slab is decoded and
  // hashed there on the load's stream.
  struct Slab {
    uint32_t group_begin, group_end;  // the span's layer groups
    uint32_t layer_begin, layer_end;  // and their layers
    std::vector<size_t> chunks;       // request indices, same record strides
    uint64_t sums_at;                 // its record checksums in sums_: K's, then V's
  };
  // Enqueues every slab; nothing on the host waits for the device.
  absl::Status EnqueueStaged(const std::vector<codec::ChunkHeader>& headers,
                             std::span<const PagedChunk> chunks,
                             const kernels::PagedKvLayout& cache, cudaStream_t stream);
  // After the last event: each staged chunk's record tables against the
  // device's checksums.
  void CheckStaged();

  GpuPagedIo* const io_;
  KvtierClient* const client_;
  const uint32_t num_layers_;
  const uint32_t layer_group_;
  std::vector<cudaEvent_t> events_;  // one per layer group
  std::vector<Hash128> keys_;        // per chunk of the request
  // Per chunk: its hold, until Finish (empty for a chunk that failed first).
  std::vector<std::optional<HeldChunk>> holds_;
  // Per chunk; a verifier writes only the entries of the chunks it checks.
  std::vector<absl::StatusOr<Tier>> results_;
  std::atomic<size_t> next_verify_{0};
  std::vector<std::thread> verifiers_;  // joined by Finish
  bool finished_ = false;
  // The staged form's state (empty otherwise).
  std::vector<Slab> slabs_;
  std::vector<codec::ChunkHeader> staged_headers_;  // per chunk of the request
  std::unique_ptr<kernels::HostStaging> halves_[2];
  cudaEvent_t copied_[2] = {nullptr, nullptr};
  cudaEvent_t free_[2] = {nullptr, nullptr};
  uint64_t* sums_ = nullptr;  // pinned, mapped (GpuPagedIo::TakeRecordSums)
  size_t sums_count_ = 0;
};

class GpuPagedIo {
 public:
  // Registers `client`'s pool mapping with the current CUDA device (mapped,
  // portable). FailedPrecondition if the client moves bytes inline (no pool)
  // or the device cannot map host memory; CUDA errors as Internal with file
  // and line.
  static absl::StatusOr<std::unique_ptr<GpuPagedIo>> Create(KvtierClient* client);
  // Unregisters the mapping and frees the workspaces.
  ~GpuPagedIo();
  GpuPagedIo(const GpuPagedIo&) = delete;
  GpuPagedIo& operator=(const GpuPagedIo&) = delete;

  KvtierClient* client() const { return client_; }

  // The handle's commit threads (kStoreBatchCommits of them, started at the
  // first call): StoreBatch's commits, and a caller's own (the C API's
  // kvtier_gpu_store_commit_async). A task may use this handle: the
  // destructor runs every queued task first.
  WorkerPool& Committers();

  // Whether a store encodes into a device staging buffer and copies the
  // chunk into the slot with the copy engine (the default), or the kernels
  // write the slot through the pool mapping (the SMs wait on PCIe). A store
  // falls back to the latter when the staging buffer cannot be allocated.
  // Create turns staging off when the environment has
  // KVTIER_GPU_STAGE_STORES=0.
  void set_stage_stores(bool on) { stage_stores_.store(on, std::memory_order_relaxed); }
  // Layers per landing group of a staged store's copy into the slot (see
  // PendingStore::Commit), 0 when the copy is one piece: set by Create when
  // the device writes 64-bit values from a stream (cuStreamWriteValue64) and
  // the environment does not have KVTIER_GPU_LANDING=0; 0 also for a chunk
  // whose layout cannot be split. Sized so that a group's records are about
  // `piece_bytes` (set_landing; default kLandingPieceBytes).
  static constexpr uint64_t kLandingPieceBytes = uint64_t{2} << 20;
  uint32_t landing_layers(const codec::ChunkLayout& layout) const;
  // Turns landing copies on (where the device can) or off.
  void set_landing(bool on, uint64_t piece_bytes = kLandingPieceBytes) {
    landing_piece_bytes_.store(std::max<uint64_t>(piece_bytes, 1));
    landing_.store(on && write_value64_ != nullptr);
  }

  // Whether Load checks the layer records it staged on the device
  // (kernels::HashStagedRecords over the bytes the decode reads; the host
  // checks the header and the record tables) instead of hashing them on the
  // host worker pool while the copy engine reads the same bytes: the
  // default; Create turns it off when the environment has
  // KVTIER_GPU_VERIFY=host. Chunks the device hash does not take (version 1,
  // records of 240 bytes or less) and unstaged loads are checked on the host.
  void set_device_verify(bool on) { device_verify_.store(on, std::memory_order_relaxed); }
  // Chunks whose records the device checked (Load, BeginLayerwiseLoad),
  // since Create.
  uint64_t chunks_checked_on_device() const {
    return chunks_checked_on_device_.load(std::memory_order_relaxed);
  }

  // Encodes the spec.geometry.num_tokens tokens at `blocks` of `cache` as a
  // chunk of `spec` and stores it as `key`. Returns once the daemon has
  // committed it (after the NVMe commit with options.durable).
  // InvalidArgument for a spec/cache/blocks mismatch (nothing is allocated);
  // the daemon's codes otherwise (ResourceExhausted when the pool is full,
  // DataLoss if the bytes in the slot do not verify). The slot is aborted on
  // any error after it was allocated.
  absl::Status Store(const Hash128& key, const codec::ChunkSpec& spec,
                     const kernels::PagedKvLayout& cache, const kernels::BlockSpan& blocks,
                     cudaStream_t stream, const PutOptions& options = {});

  // Stores chunks[i] (spec.geometry.num_tokens tokens at chunks[i].blocks of
  // `cache`) as chunks[i].key, each as Store would: the encodes and copies
  // run in order on `stream`, up to kStoreBatchDepth chunks ahead of the
  // oldest one this thread waits for; once a chunk is in its slot, its
  // commit (the daemon's seal) runs on the handle's commit threads, up to
  // kStoreBatchCommits of this call's at once, so neither the device nor
  // the next encodes wait for the daemon. Commits may complete out of order.
  // Returns once every commit has. One status per chunk, Store's codes; a
  // chunk that fails does not stop the others (the daemon's pool filling up
  // fails the rest alike).
  static constexpr size_t kStoreBatchDepth = 3;
  static constexpr size_t kStoreBatchCommits = 4;
  std::vector<absl::Status> StoreBatch(std::span<const PagedChunk> chunks,
                                       const codec::ChunkSpec& spec,
                                       const kernels::PagedKvLayout& cache, cudaStream_t stream,
                                       const PutOptions& options = {});

  // Reserves a slot for a chunk of `spec` to be encoded by layer ranges
  // (PendingStore::EncodeLayers) and stored by PendingStore::Commit.
  // InvalidArgument for an invalid spec; the daemon's codes for the slot.
  absl::StatusOr<std::unique_ptr<PendingStore>> BeginStore(const codec::ChunkSpec& spec);

  // Decodes layers `layers` of chunk `key` into the same layers of the slots
  // at `blocks` of `cache` (the chunk's geometry must match the cache) and
  // returns the tier it came from. Returns after the kernel has finished
  // (the extent is released then). The header is checked before the launch
  // and the layer records on the device after the copy (set_device_verify)
  // or on the host worker pool while the kernel runs, so on DataLoss the
  // slots at `blocks` hold undefined values. NotFound on a miss;
  // DataLoss if the chunk is corrupt (the daemon drops it); InvalidArgument
  // for a geometry/cache/blocks/layers mismatch (nothing launched).
  absl::StatusOr<Tier> Load(const Hash128& key, const kernels::PagedKvLayout& cache,
                            const kernels::BlockSpan& blocks, cudaStream_t stream,
                            kernels::LayerRange layers = {});

  // Holds every chunk of `chunks`, checks each one's header and its
  // geometry against `cache`, then enqueues on `stream`, for each group of
  // `layer_group` layers, the decode of that group of every chunk that
  // passed, followed by the group's event; the records are checked after or
  // while they decode (results()). With the device check (set_device_verify)
  // and every chunk held at once, the staged form: one HoldBatch, spans of
  // groups of at least 8 MiB of each chunk's records copied by a copy stream
  // into two device buffers in turn, each span decoded and hashed there, its
  // groups' events recorded together. Otherwise the holds run over up to
  // the client's data-plane connections at once, the kernels read the pool
  // and host threads hash the chunks. Nothing on the host waits for the
  // device. A chunk that misses or fails its checks is reported in
  // results() and skipped. When kvtierd's hold limit refuses
  // chunks while this load holds others, the load runs in rounds: it waits
  // for the decodes of what it holds, checks and releases those chunks, then
  // holds the refused ones again (the host waits here; a chunk fails with
  // ResourceExhausted only when refused while the load holds nothing).
  // InvalidArgument (nothing held) for
  // layer_group 0, an invalid cache, or an empty `chunks`; a launch error
  // unholds everything and is returned.
  absl::StatusOr<std::unique_ptr<LayerwiseLoad>> BeginLayerwiseLoad(
      std::span<const PagedChunk> chunks, const kernels::PagedKvLayout& cache,
      uint32_t layer_group, cudaStream_t stream);

 private:
  friend class PendingStore;
  friend class LayerwiseLoad;
  GpuPagedIo(KvtierClient* client, std::span<uint8_t> pool, uint8_t* device_pool)
      : client_(client), pool_(pool), device_pool_(device_pool) {}
  // The device address of host bytes inside the registered pool.
  // REQUIRES: InPool(host bytes) is OK.
  const uint8_t* Device(const uint8_t* host) const { return device_pool_ + (host - pool_.data()); }
  // OK if `bytes` lie in the registered pool; FailedPrecondition if not (the
  // client remapped the pool of a restarted daemon: this handle's
  // registration is of the old one).
  absl::Status InPool(std::span<const uint8_t> bytes) const;
  // The header of held chunk `key`, checked before a launch (it sizes every
  // read): the bytes lie in the registered pool (FailedPrecondition), the
  // header parses and the chunk is as long as it says (DataLoss otherwise,
  // ParseStoredHeader: stored bytes that do not parse have rotted).
  absl::StatusOr<codec::ChunkHeader> HeldHeader(const Hash128& key, const HeldChunk& held) const;
  // A layer-wise load's hold `h` of `chunk` (or its failure): OK (its tier)
  // once the header parses and the chunk fits `cache` and its blocks, with
  // *held and *header set; else the hold ended and the chunk's status (a
  // rotted header, DataLoss, has kvtierd check the stored chunk).
  absl::StatusOr<Tier> AcceptHeld(const PagedChunk& chunk, const kernels::PagedKvLayout& cache,
                                  absl::StatusOr<HeldChunk> h, std::optional<HeldChunk>* held,
                                  codec::ChunkHeader* header);
  // A zeroed GatherEncode workspace (from the pool, or a new one).
  absl::StatusOr<uint32_t*> TakeWorkspace();
  // Returns a workspace whose launches have all completed (it is zero
  // again), or frees a `dirty` one (a launch failed part-way).
  void ReturnWorkspace(uint32_t* ws, bool dirty);
  // A staging buffer of at least `bytes` for one Load (from the pool, grown
  // if needed, or a new one).
  absl::StatusOr<std::unique_ptr<kernels::HostStaging>> TakeStaging(size_t bytes);
  // Returns a staging buffer whose launches have all completed.
  void ReturnStaging(std::unique_ptr<kernels::HostStaging> staging);
  // Pinned, device-mapped room for 2 * codec::kMaxLayers record checksums
  // (a device-verified Load's), from the pool or new; returned when no
  // launch writes it any more.
  absl::StatusOr<uint64_t*> TakeRecordSums(size_t count = 2 * size_t{codec::kMaxLayers});
  void ReturnRecordSums(uint64_t* sums, size_t count = 2 * size_t{codec::kMaxLayers});
  // The stream staged layer-wise loads copy on (created at first use; the
  // handle's concurrent loads share it, so their copies, which share the
  // link anyway, run one after another).
  absl::StatusOr<cudaStream_t> CopyStream();

  KvtierClient* const client_;
  const std::span<uint8_t> pool_;
  uint8_t* const device_pool_;
  std::atomic<bool> stage_stores_{true};
  std::atomic<bool> device_verify_{true};
  std::atomic<uint64_t> chunks_checked_on_device_{0};
  // cuStreamWriteValue64 (the driver's, through the runtime's entry point
  // lookup: libkvtier links no libcuda), or null.
  void* write_value64_ = nullptr;
  std::atomic<bool> landing_{false};
  std::atomic<uint64_t> landing_piece_bytes_{kLandingPieceBytes};
  absl::Mutex commit_mu_;
  std::unique_ptr<WorkerPool> committers_ ABSL_GUARDED_BY(commit_mu_);  // Committers()
  absl::Mutex ws_mu_;
  std::vector<uint32_t*> free_workspaces_ ABSL_GUARDED_BY(ws_mu_);
  std::vector<uint32_t*> all_workspaces_ ABSL_GUARDED_BY(ws_mu_);
  std::vector<std::unique_ptr<kernels::HostStaging>> free_stagings_ ABSL_GUARDED_BY(ws_mu_);
  // Pinned record-sum buffers and their u64 counts.
  std::vector<std::pair<uint64_t*, size_t>> free_record_sums_ ABSL_GUARDED_BY(ws_mu_);
  cudaStream_t copy_stream_ ABSL_GUARDED_BY(ws_mu_) = nullptr;
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_KVTIER_GPU_H_
