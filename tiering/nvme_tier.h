// NVMe tier: chunk objects in one preallocated O_DIRECT data file, written and
// read through a BlockDevice (io_uring in production), with a RocksDB index
// mapping object -> extent. See docs/tiering.md "NVMe on-disk layout".
//
// Durability contract: a synced Put (the default, and Tier::Put) returns OK
// only after the data was synced (fdatasync) and then the index entry was
// committed (RocksDB, sync=true). Index changes go through one commit
// thread that batches them: one fdatasync covers the data of every queued
// Put (all written before they queued), then one synced RocksDB write
// batch commits all their entries, so concurrent Puts share both syncs.
// An unsynced Put (TierPutOptions::sync = false) returns once its data is
// written: it is readable at once and the next batch commits it the same
// way; a crash before that commit loses it, never corrupts anything.
// After a crash, every object whose Put returned OK is readable; an object
// whose index entry did not commit is invisible and its space is free.
// Reads verify the chunk checksums; a mismatch returns DataLoss and drops
// the entry.
#ifndef KVTIER_TIERING_NVME_TIER_H_
#define KVTIER_TIERING_NVME_TIER_H_

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "tiering/disk_probe.h"
#include "tiering/extent_allocator.h"
#include "tiering/io.h"
#include "tiering/tier.h"

namespace rocksdb {
class DB;
}

namespace kvtier::tiering {

struct NvmeTierOptions {
  // Data directory; holds the data file "data.kvt" and the index "index/".
  // Created if missing. Default: "" (required)
  std::string dir;
  // Size of the data file: the hard limit on chunk bytes on disk. The file
  // is preallocated to this size and never grows. Default: 4 GiB
  uint64_t capacity_bytes = uint64_t{4} << 30;
  // Largest single read or write request; a chunk is split into requests of
  // this size that run concurrently up to the device's queue depth.
  // Default: 1 MiB
  uint64_t max_io_bytes = uint64_t{1} << 20;
  // Identifies the geometry/codec configuration whose chunks this tier holds
  // (e.g. model fingerprint + codec name + chunk tokens). Stored in the
  // index; on open with a different value the old chunks are never served.
  // Default: "" (an empty fingerprint is a fingerprint like any other)
  std::string config_fingerprint;
  // On a fingerprint mismatch at open: true drops every old entry and adopts
  // the new fingerprint; false fails Open with FailedPrecondition.
  // Default: true
  bool discard_on_config_mismatch = true;
  // I/O environment for the data file (not owned). Default: nullptr, an
  // io_uring environment owned by the tier (queue depth `queue_depth`).
  IoEnv* env = nullptr;
  // io_uring queue depth when the tier creates its own environment.
  // Default: 32
  uint32_t queue_depth = 32;
  // How long the commit thread lets unsynced Puts accumulate before it
  // commits them (a synced Put, Erase or Flush commits at once, taking the
  // accumulated ones along). Fewer, larger commits mean fewer device
  // flushes competing with data writes. Default: 2000
  uint32_t unsynced_commit_delay_us = 2000;
  // Bytes of a read probe of the disk under `dir` (ProbeDiskRead: a
  // temporary file written, then read back with O_DIRECT), run on a thread of
  // its own once the tier is open, so that bandwidth() gives the disk's read
  // rate before the tier has read any object of its own (the load-or-recompute
  // plan prices loads at it). 0: no probe; bandwidth() stays zero until the
  // first read. Default: 0 (kvtierd: 64 MiB)
  uint64_t read_probe_bytes = 0;
};

// Disk space the tier's index (RocksDB: tables, write-ahead log, manifest,
// info log) may take beside the data file: max(16 MiB, capacity / 32). The
// index's write buffer and log sizes are derived from it, so the tier's
// directory stays within capacity_bytes plus this allowance
// (docs/tiering.md "Disk budget").
uint64_t NvmeIndexAllowanceBytes(uint64_t capacity_bytes);

class NvmeTier : public Tier {
 public:
  // Opens or creates the tier and rebuilds the free-space map from the
  // index. Entries that overlap, lie past the data file, or are malformed
  // are dropped. FailedPrecondition on a config mismatch (when not
  // discarding) or if the index is locked by another process.
  static absl::StatusOr<std::unique_ptr<NvmeTier>> Open(const NvmeTierOptions& options);
  ~NvmeTier() override;

  TierKind kind() const override { return TierKind::kNvme; }
  TierCapabilities capabilities() const override {
    return TierCapabilities{.durable = true, .verifies_on_read = true};
  }
  uint64_t capacity_bytes() const override { return capacity_; }
  uint64_t used_bytes() const override;
  Bandwidth bandwidth() const override { return meter_.Get(); }

  // `bytes` must start with a valid chunk header (InvalidArgument; parsed
  // here unless options.header gives it). options.sync: see the durability
  // contract above.
  using Tier::Put;
  absl::Status Put(const ObjectKey& id, std::span<const uint8_t> bytes,
                   const TierPutOptions& options) override;
  // Waits until every Put that returned before the call is committed.
  // Returns the first error of a commit of unsynced Puts since the previous
  // Flush (those Puts were dropped: not readable, not on disk), if any.
  absl::Status Flush() override;
  absl::StatusOr<uint64_t> Size(const ObjectKey& id) override;
  absl::Status Read(const ObjectKey& id, std::span<uint8_t> out) override;
  // Read of every object into the buffer beside it, with the requests of
  // all of them in one submission (up to the device's queue depth in
  // flight), each object's checksums computed as its bytes arrive. One
  // status per object, as Read would return it; InvalidArgument for every
  // object if the spans differ in number. When the submission fails, the
  // objects it did not finish are read again one by one, so a device error
  // or a short read is reported for its own object only.
  std::vector<absl::Status> ReadBatch(std::span<const ObjectKey> ids,
                                      std::span<const std::span<uint8_t>> outs) override;
  absl::Status Erase(const ObjectKey& id) override;
  std::vector<std::pair<ObjectKey, uint64_t>> List() override;

  // Path of the data file and the byte offset of object `id` in it (for
  // tests that corrupt data on disk). NotFound if absent.
  std::string data_path() const { return data_path_; }
  absl::StatusOr<uint64_t> OffsetOf(const ObjectKey& id);
  // Entries dropped at open because of a config mismatch or bad extents.
  uint64_t dropped_at_open() const { return dropped_at_open_; }
  // Waits for the read probe (options.read_probe_bytes) and returns what it
  // measured, or why it could not run; FailedPrecondition when none was asked for.
  absl::StatusOr<DiskReadProbe> WaitForReadProbe();

 private:
  struct Entry {
    uint64_t offset;
    uint64_t length;
    uint64_t header_checksum;
  };
  NvmeTier(const NvmeTierOptions& o, std::unique_ptr<IoEnv> owned_env,
           std::unique_ptr<BlockDevice> dev, rocksdb::DB* db, uint64_t capacity);
  absl::Status Recover();
  // Reads entry `e` of object `id` into `out` (its length) and verifies it
  // as the bytes arrive. `*corrupt`: the bytes arrived and failed their
  // checksums (DataLoss; the caller drops the entry). Other errors are the
  // device's. REQUIRES: the caller holds a reference on the extent.
  absl::Status ReadEntry(const ObjectKey& id, const Entry& e, std::span<uint8_t> out, bool* corrupt);
  // Moves `len` bytes between `data` and the data file at `offset`, in
  // requests of max_io_bytes; `data` is used in place where it is
  // block-aligned, the rest goes through a bounce buffer. For a read,
  // `on_prefix(n)` is called each time the bytes data[0, n) have all
  // arrived, n growing to `len`, while later requests may be in flight.
  absl::Status DoIo(IoRequest::Op op, uint64_t offset, uint8_t* data, uint64_t len,
                    absl::FunctionRef<void(uint64_t)> on_prefix = [](uint64_t) {});
  // One index change queued for the commit thread.
  struct PendingCommit {
    enum class Op : uint8_t { kPut, kDelete, kMarker } op;
    std::string key, value;
    // Unsynced Puts: the object, its extent and the extent it replaced,
    // finished by the commit thread (a synced Put finishes itself).
    bool async = false;
    ObjectKey id;
    uint64_t offset = 0;
    std::optional<uint64_t> replaced;
    bool waited = false;  // a caller waits for it: commit without delay
    absl::Status result;
    bool done = false;
  };
  // Queues `c` for the commit thread. REQUIRES: a Put's data write has
  // completed. Lock order: mu_ may be held, then commit_mu_.
  void Enqueue(std::shared_ptr<PendingCommit> c);
  // Queues `c` and waits for its batch; returns the batch's status.
  absl::Status EnqueueAndWait(std::shared_ptr<PendingCommit> c);
  void CommitLoop();
  // Bounce buffers for the unaligned parts of caller buffers, reused so that
  // an unaligned Put does not map and fault in fresh pages every time.
  AlignedBuffer TakeBounce(uint64_t bytes);
  void ReturnBounce(AlignedBuffer buf);
  absl::Status DropEntry(const ObjectKey& id, uint64_t offset);
  void Unref(uint64_t offset) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const NvmeTierOptions options_;
  std::unique_ptr<IoEnv> owned_env_;
  std::unique_ptr<BlockDevice> dev_;
  rocksdb::DB* db_;
  const uint64_t capacity_;
  const uint64_t block_;
  std::string data_path_;
  uint64_t dropped_at_open_ = 0;
  BandwidthMeter meter_;

  mutable absl::Mutex mu_;
  absl::CondVar writing_done_;
  ExtentAllocator alloc_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ObjectKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Allocated extents by offset: length and references (1 for the entry or
  // the in-progress write, +1 per reader). Freed at zero.
  struct Extent {
    uint64_t length;
    int refs;
  };
  absl::flat_hash_map<uint64_t, Extent> extents_ ABSL_GUARDED_BY(mu_);
  // Objects with a Put in progress (a second Put of the same id waits).
  absl::flat_hash_set<ObjectKey> writing_ ABSL_GUARDED_BY(mu_);

  // Index changes waiting for the commit thread, in the order they must
  // apply (a Delete queued after a Put of the same key wins).
  absl::Mutex commit_mu_;
  std::vector<std::shared_ptr<PendingCommit>> commit_queue_ ABSL_GUARDED_BY(commit_mu_);
  bool stopping_ ABSL_GUARDED_BY(commit_mu_) = false;
  int waiters_ ABSL_GUARDED_BY(commit_mu_) = 0;  // queued ops someone waits for
  absl::Status unsynced_commit_error_ ABSL_GUARDED_BY(commit_mu_);  // for Flush
  std::thread commit_thread_;

  absl::Mutex bounce_mu_;
  std::vector<AlignedBuffer> bounce_pool_ ABSL_GUARDED_BY(bounce_mu_);

  // The read probe: its result once probe_thread_ finished.
  absl::Mutex probe_mu_;
  std::optional<absl::StatusOr<DiskReadProbe>> probe_result_ ABSL_GUARDED_BY(probe_mu_);
  std::thread probe_thread_;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_NVME_TIER_H_
