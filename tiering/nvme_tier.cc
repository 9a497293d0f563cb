#include "tiering/nvme_tier.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "codec/chunk.h"
#include "codec/section_hashes.h"
#include "common/coding.h"
#include "common/status.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace kvtier::tiering {
namespace {

// Index keys (docs/tiering.md "NVMe on-disk layout").
constexpr char kObjectPrefix[] = "o/";        // "o/" + key (16 bytes) + part (1 byte)
constexpr char kConfigKey[] = "m/config";     // the config fingerprint
constexpr char kLayoutKey[] = "m/layout";     // "kvtier-nvme-v1"
constexpr char kLayoutVersion[] = "kvtier-nvme-v1";

// Index value: fixed 40 bytes, little-endian.
constexpr size_t kValVersion = 0;      // u32 = 1
constexpr size_t kValPart = 4;         // u8, then 3 bytes 0
constexpr size_t kValOffset = 8;       // u64: byte offset in data.kvt
constexpr size_t kValLength = 16;      // u64: object bytes
constexpr size_t kValHeaderCk = 24;    // u64: the object's header_checksum field
constexpr size_t kValChecksum = 32;    // u64: XXH3-64 of bytes [0, 32)
constexpr size_t kValSize = 40;
constexpr uint32_t kEntryVersion = 1;

// Bounce buffers kept for reuse (one per concurrent unaligned I/O).
constexpr size_t kMaxPooledBounceBuffers = 4;

std::string IndexKey(const ObjectKey& id) {
  std::string k(kObjectPrefix);
  k.append(reinterpret_cast<const char*>(id.key.bytes.data()), Hash128::kSize);
  k.push_back(static_cast<char>(id.part));
  return k;
}

absl::Status RocksStatus(const rocksdb::Status& s, const char* what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat("rocksdb ", what, ": ", s.ToString());
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(msg);
  if (s.IsBusy() || s.IsTryAgain() || s.IsTimedOut()) return absl::UnavailableError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) {
    return absl::FailedPreconditionError(msg);
  }
  return absl::InternalError(msg);
}

std::string EncodeEntry(Part part, uint64_t offset, uint64_t length, uint64_t hdr_ck) {
  uint8_t v[kValSize] = {};
  StoreLE<uint32_t>(v + kValVersion, kEntryVersion);
  v[kValPart] = static_cast<uint8_t>(part);
  StoreLE<uint64_t>(v + kValOffset, offset);
  StoreLE<uint64_t>(v + kValLength, length);
  StoreLE<uint64_t>(v + kValHeaderCk, hdr_ck);
  StoreLE<uint64_t>(v + kValChecksum, Checksum64({v, kValChecksum}));
  return std::string(reinterpret_cast<char*>(v), kValSize);
}

// Verifies an object while it is read: hashes each codec section
// (codec::SectionHashes, the XXH3-64 of codec::VerifySection) as the
// contiguous prefix of the object that has arrived grows, so that once the
// last request completes only its own bytes remain to be hashed. Anything
// out of the ordinary (a malformed header, a length or checksum mismatch) is
// left to VerifyObject over the whole object, so that the errors are exactly
// its. Not thread-safe.
class StreamingVerifier {
 public:
  // `object` is the buffer being read into; `index_header_checksum` the
  // header checksum the index entry recorded.
  StreamingVerifier(const ObjectKey& id, uint64_t index_header_checksum,
                    std::span<const uint8_t> object)
      : id_(id), index_header_checksum_(index_header_checksum), object_(object) {}

  // Bytes [0, prefix) of the object have arrived. `prefix` never shrinks.
  void Advance(uint64_t prefix) {
    if (header_mismatch_ || fallback_) return;
    if (!header_seen_) {
      if (prefix < codec::kHeaderSize) return;
      header_seen_ = true;
      if (!StartSections()) return;
    }
    if (prefix > hashed_) {
      hashes_.Update(object_.data(), hashed_, prefix);
      hashed_ = prefix;
    }
    for (; checked_ < hashes_.num_sections() && hashes_.Complete(checked_); ++checked_) {
      if (!hashes_.Matches(checked_)) {
        fallback_ = true;
        return;
      }
    }
  }

  // The verdict once the whole object arrived: OK, or DataLoss (with the
  // message VerifyObject gives, prefixed "nvme: ").
  absl::Status Finish() {
    if (header_mismatch_) return absl::DataLossError("stored header does not match the index entry");
    if (header_seen_ && !fallback_ && checked_ == hashes_.num_sections()) return absl::OkStatus();
    absl::Status st = VerifyObject(id_, object_);
    // The streamed hash and a second look disagree only if the bytes changed
    // under the read (a caller writing into the buffer): not servable.
    if (st.ok()) st = absl::DataLossError("checksum mismatch while the object was read");
    return absl::DataLossError(absl::StrCat("nvme: ", st.message()));
  }

 private:
  // Checks the header against the index entry, parses it and lays out the
  // sections of the object (false: nothing more to hash here).
  bool StartSections() {
    if (LoadLE<uint64_t>(object_.data() + codec::kOffHeaderChecksum) != index_header_checksum_) {
      header_mismatch_ = true;
      return false;
    }
    auto h = codec::ParseHeader(object_);
    if (!h.ok()) {
      fallback_ = true;
      return false;
    }
    // The sections follow the header back to back: K then V, or the one
    // section of a split object.
    codec::SectionHashes::Range sections[codec::SectionHashes::kMaxSections];
    size_t n = 0;
    uint64_t end = codec::kHeaderSize;
    if (id_.part != Part::kV) {
      sections[n++] = codec::SectionHashes::Range::Of(*h, codec::Section::kK, end);
      end += h->layout.k.bytes;
    }
    if (id_.part != Part::kK) {
      sections[n++] = codec::SectionHashes::Range::Of(*h, codec::Section::kV, end);
      end += h->layout.v.bytes;
    }
    if (end != object_.size()) {
      fallback_ = true;
      return false;
    }
    hashes_.Reset(std::span(sections, n));
    hashed_ = codec::kHeaderSize;
    return true;
  }

  const ObjectKey id_;
  const uint64_t index_header_checksum_;
  const std::span<const uint8_t> object_;
  bool header_seen_ = false;
  bool header_mismatch_ = false;
  bool fallback_ = false;  // leave the verdict to VerifyObject
  codec::SectionHashes hashes_;
  size_t checked_ = 0;   // sections hashed whole and matching, in order
  uint64_t hashed_ = 0;  // object bytes fed to hashes_ so far (from kHeaderSize on)
};

}  // namespace

uint64_t NvmeIndexAllowanceBytes(uint64_t capacity_bytes) {
  return std::max<uint64_t>(uint64_t{16} << 20, capacity_bytes / 32);
}

absl::StatusOr<std::unique_ptr<NvmeTier>> NvmeTier::Open(const NvmeTierOptions& o) {
  if (o.dir.empty()) return absl::InvalidArgumentError("NvmeTierOptions::dir is required");
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", o.dir, ": ", ec.message()));
  std::unique_ptr<IoEnv> owned;
  IoEnv* env = o.env;
  if (env == nullptr) {
    IoEnvOptions io;
    io.queue_depth = o.queue_depth;
    owned = NewUringIoEnv(io);
    env = owned.get();
  }
  const uint64_t block = 4096;
  const uint64_t capacity = o.capacity_bytes / block * block;
  if (capacity == 0) return absl::InvalidArgumentError("NVMe capacity below one block");

  rocksdb::Options ro;
  ro.create_if_missing = true;
  ro.max_open_files = 64;
  // The index's files are sized from its allowance: memtables and the
  // write-ahead log at a sixteenth of it each (the log is not preallocated:
  // RocksDB would reserve 1.1 x the write buffer per log file), info logs
  // and the manifest at a sixteenth in all; tables hold about 100 bytes per
  // chunk.
  const uint64_t allowance = NvmeIndexAllowanceBytes(capacity);
  ro.write_buffer_size = std::clamp<uint64_t>(allowance / 16, uint64_t{1} << 20, uint64_t{64} << 20);
  ro.max_write_buffer_number = 2;
  ro.max_total_wal_size = ro.write_buffer_size;
  ro.allow_fallocate = false;
  ro.target_file_size_base = ro.write_buffer_size;
  ro.max_bytes_for_level_base = 4 * ro.write_buffer_size;
  ro.max_log_file_size = allowance / 64;
  ro.keep_log_file_num = 2;
  ro.max_manifest_file_size = allowance / 64;
  ro.recycle_log_file_num = 1;
  rocksdb::DB* db = nullptr;
  KVTIER_RETURN_IF_ERROR(RocksStatus(rocksdb::DB::Open(ro, o.dir + "/index", &db), "open"));
  std::unique_ptr<rocksdb::DB> db_guard(db);

  auto dev = env->OpenDevice(o.dir + "/data.kvt", capacity);
  if (!dev.ok()) return dev.status();
  if ((*dev)->block_size() != block) return absl::InvalidArgumentError("device block size must be 4096");
  std::unique_ptr<NvmeTier> t(new NvmeTier(o, std::move(owned), std::move(*dev), db_guard.release(), capacity));
  KVTIER_RETURN_IF_ERROR(t->Recover());
  if (o.read_probe_bytes > 0) {
    NvmeTier* tier = t.get();
    tier->probe_thread_ = std::thread([tier] {
      absl::StatusOr<DiskReadProbe> probe =
          ProbeDiskRead(tier->options_.dir, tier->options_.read_probe_bytes, /*repeats=*/1);
      if (probe.ok()) tier->meter_.Add(/*write=*/false, probe->bytes, probe->micros);
      absl::MutexLock l(&tier->probe_mu_);
      tier->probe_result_ = std::move(probe);
    });
  }
  return t;
}

absl::StatusOr<DiskReadProbe> NvmeTier::WaitForReadProbe() {
  if (options_.read_probe_bytes == 0) {
    return absl::FailedPreconditionError("the tier was opened without a read probe");
  }
  absl::MutexLock l(&probe_mu_);
  probe_mu_.Await(absl::Condition(
      +[](std::optional<absl::StatusOr<DiskReadProbe>>* r) { return r->has_value(); },
      &probe_result_));
  return *probe_result_;
}

NvmeTier::NvmeTier(const NvmeTierOptions& o, std::unique_ptr<IoEnv> owned_env,
                   std::unique_ptr<BlockDevice> dev, rocksdb::DB* db, uint64_t capacity)
    : options_(o),
      owned_env_(std::move(owned_env)),
      dev_(std::move(dev)),
      db_(db),
      capacity_(capacity),
      block_(dev_->block_size()),
      data_path_(o.dir + "/data.kvt"),
      alloc_(capacity, dev_->block_size()) {
  commit_thread_ = std::thread([this] { CommitLoop(); });
}

NvmeTier::~NvmeTier() {
  if (probe_thread_.joinable()) probe_thread_.join();
  {
    absl::MutexLock l(&commit_mu_);
    stopping_ = true;
  }
  commit_thread_.join();  // commits what is queued first
  dev_.reset();
  delete db_;
}

absl::Status NvmeTier::Recover() {
  rocksdb::WriteOptions wo;
  wo.sync = true;
  std::string config, layout;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), kConfigKey, &config);
  bool have_config = s.ok();
  if (!s.ok() && !s.IsNotFound()) return RocksStatus(s, "get config");
  s = db_->Get(rocksdb::ReadOptions(), kLayoutKey, &layout);
  if (s.ok() && layout != kLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrCat("unknown NVMe layout ", layout));
  }
  bool mismatch = have_config && config != options_.config_fingerprint;
  if (mismatch && !options_.discard_on_config_mismatch) {
    return absl::FailedPreconditionError(
        absl::StrCat("NVMe tier holds chunks of config '", config, "', opened with '",
                     options_.config_fingerprint, "'"));
  }
  rocksdb::WriteBatch drop;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  absl::MutexLock l(&mu_);
  for (it->Seek(kObjectPrefix); it->Valid() && it->key().starts_with(kObjectPrefix); it->Next()) {
    rocksdb::Slice k = it->key(), v = it->value();
    const auto* vb = reinterpret_cast<const uint8_t*>(v.data());
    bool ok = !mismatch && k.size() == 2 + Hash128::kSize + 1 && v.size() == kValSize &&
              LoadLE<uint32_t>(vb + kValVersion) == kEntryVersion &&
              LoadLE<uint64_t>(vb + kValChecksum) == Checksum64({vb, kValChecksum});
    ObjectKey id;
    Entry e{};
    if (ok) {
      std::memcpy(id.key.bytes.data(), k.data() + 2, Hash128::kSize);
      id.part = static_cast<Part>(k.data()[2 + Hash128::kSize]);
      e = Entry{LoadLE<uint64_t>(vb + kValOffset), LoadLE<uint64_t>(vb + kValLength),
                LoadLE<uint64_t>(vb + kValHeaderCk)};
      ok = static_cast<uint8_t>(id.part) <= 2 && e.length >= codec::kHeaderSize &&
           alloc_.MarkUsed(e.offset, e.length);
    }
    if (!ok) {
      drop.Delete(k);
      ++dropped_at_open_;
      continue;
    }
    entries_[id] = e;
    extents_[e.offset] = Extent{e.length, 1};
  }
  KVTIER_RETURN_IF_ERROR(RocksStatus(it->status(), "scan"));
  drop.Put(kConfigKey, options_.config_fingerprint);
  drop.Put(kLayoutKey, kLayoutVersion);
  return RocksStatus(db_->Write(wo, &drop), "recover");
}

uint64_t NvmeTier::used_bytes() const {
  absl::MutexLock l(&mu_);
  return alloc_.used();
}

void NvmeTier::Unref(uint64_t offset) {
  auto it = extents_.find(offset);
  if (it == extents_.end()) return;
  if (--it->second.refs == 0) {
    alloc_.Free(offset, it->second.length);
    extents_.erase(it);
  }
}

// Moves `len` bytes between `data` and the device at `offset` (a block
// multiple). Block-aligned parts of an aligned caller buffer are transferred
// in place; the rest goes through a bounce buffer.
absl::Status NvmeTier::DoIo(IoRequest::Op op, uint64_t offset, uint8_t* data, uint64_t len,
                            absl::FunctionRef<void(uint64_t)> on_prefix) {
  const uint64_t rounded = (len + block_ - 1) / block_ * block_;
  uint64_t direct = 0;
  if (reinterpret_cast<uintptr_t>(data) % block_ == 0) direct = len / block_ * block_;
  AlignedBuffer bounce;
  if (rounded > direct) {
    bounce = TakeBounce(rounded - direct);
    if (bounce.data() == nullptr) return absl::ResourceExhaustedError("bounce buffer");
    if (op == IoRequest::Op::kWrite) {
      std::memcpy(bounce.data(), data + direct, len - direct);
      std::memset(bounce.data() + (len - direct), 0, rounded - len);
    }
  }
  std::vector<IoRequest> reqs;
  auto add = [&](uint8_t* buf, uint64_t dev_off, uint64_t n) {
    for (uint64_t done = 0; done < n; done += options_.max_io_bytes) {
      uint64_t m = std::min<uint64_t>(options_.max_io_bytes, n - done);
      reqs.push_back(IoRequest{op, dev_off + done, buf + done, m});
    }
  };
  if (direct > 0) add(data, offset, direct);
  if (rounded > direct) add(bounce.data(), offset + direct, rounded - direct);
  absl::Status st;
  if (op == IoRequest::Op::kWrite) {
    st = dev_->Submit(reqs);
  } else {
    // The requests are in object order: report the contiguous prefix that
    // has arrived (tail bytes count once copied out of the bounce buffer).
    std::vector<bool> arrived(reqs.size());
    size_t next = 0;  // first request not yet part of the reported prefix
    auto start = [&](size_t i) { return reqs[i].offset - offset; };
    st = dev_->SubmitWithCompletions(reqs, [&](size_t i) {
      if (start(i) >= direct) {
        const uint64_t n = std::min(reqs[i].len, len - start(i));
        std::memcpy(data + start(i), reqs[i].buf, n);
      }
      arrived[i] = true;
      if (i != next) return;
      while (next < reqs.size() && arrived[next]) ++next;
      on_prefix(next == reqs.size() ? len : start(next));
    });
    if (st.ok() && next != reqs.size()) {
      st = absl::InternalError("block device reported success without completing every read");
    }
  }
  if (bounce.data() != nullptr) ReturnBounce(std::move(bounce));
  return st;
}

AlignedBuffer NvmeTier::TakeBounce(uint64_t bytes) {
  {
    absl::MutexLock l(&bounce_mu_);
    for (size_t i = 0; i < bounce_pool_.size(); ++i) {
      if (bounce_pool_[i].size() >= bytes) {
        AlignedBuffer b = std::move(bounce_pool_[i]);
        bounce_pool_.erase(bounce_pool_.begin() + static_cast<ptrdiff_t>(i));
        return b;
      }
    }
  }
  return AlignedBuffer(bytes, block_);
}

void NvmeTier::ReturnBounce(AlignedBuffer buf) {
  absl::MutexLock l(&bounce_mu_);
  if (bounce_pool_.size() < kMaxPooledBounceBuffers) {
    bounce_pool_.push_back(std::move(buf));
    return;
  }
  // Keep the larger buffers: replace the smallest if this one is bigger.
  auto smallest = std::min_element(bounce_pool_.begin(), bounce_pool_.end(),
                                   [](const AlignedBuffer& a, const AlignedBuffer& b) {
                                     return a.size() < b.size();
                                   });
  if (smallest->size() < buf.size()) *smallest = std::move(buf);
}

void NvmeTier::Enqueue(std::shared_ptr<PendingCommit> c) {
  absl::MutexLock l(&commit_mu_);
  if (c->waited) ++waiters_;
  commit_queue_.push_back(std::move(c));
}

absl::Status NvmeTier::EnqueueAndWait(std::shared_ptr<PendingCommit> c) {
  c->waited = true;
  Enqueue(c);
  absl::MutexLock l(&commit_mu_);
  commit_mu_.Await(absl::Condition(+[](PendingCommit* p) { return p->done; }, c.get()));
  return c->result;
}

void NvmeTier::CommitLoop() {
  for (;;) {
    std::vector<std::shared_ptr<PendingCommit>> batch;
    {
      absl::MutexLock l(&commit_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_) {
        return stopping_ || !commit_queue_.empty();
      };
      commit_mu_.Await(absl::Condition(&ready));
      if (commit_queue_.empty()) return;  // stopping, nothing left
      // Only unsynced Puts queued: let more join this commit for a while.
      auto urgent = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_) {
        return stopping_ || waiters_ > 0;
      };
      commit_mu_.AwaitWithTimeout(absl::Condition(&urgent),
                                  absl::Microseconds(options_.unsynced_commit_delay_us));
      batch.swap(commit_queue_);
    }
    // Every queued Put's data write completed before it queued, so one
    // fdatasync makes all of it durable before any of their entries commit.
    rocksdb::WriteBatch wb;
    bool has_put = false;
    for (const auto& c : batch) {
      if (c->op == PendingCommit::Op::kPut) {
        wb.Put(c->key, c->value);
        has_put = true;
      } else if (c->op == PendingCommit::Op::kDelete) {
        wb.Delete(c->key);
      }
    }
    absl::Status st;
    if (has_put) st = dev_->Sync();
    if (st.ok() && wb.Count() > 0) {
      rocksdb::WriteOptions wo;
      wo.sync = true;
      st = RocksStatus(db_->Write(wo, &wb), "commit");
    }
    {
      // Finish unsynced Puts: free the extent each one replaced once the new
      // entry is durable; on failure drop the entry (its replaced extent
      // stays allocated: the durable index may still name it).
      absl::MutexLock l(&mu_);
      for (const auto& c : batch) {
        if (!c->async) continue;
        if (st.ok()) {
          if (c->replaced) Unref(*c->replaced);
          continue;
        }
        auto it = entries_.find(c->id);
        if (it != entries_.end() && it->second.offset == c->offset) {
          entries_.erase(it);
          Unref(c->offset);
        }
      }
    }
    absl::MutexLock l(&commit_mu_);
    for (const auto& c : batch) {
      if (c->waited) --waiters_;
      if (!st.ok() && c->async && unsynced_commit_error_.ok()) unsynced_commit_error_ = st;
      c->result = st;
      c->done = true;
    }
  }
}

absl::Status NvmeTier::Flush() {
  auto marker = std::make_shared<PendingCommit>();
  marker->op = PendingCommit::Op::kMarker;
  (void)EnqueueAndWait(std::move(marker));  // a marker alone commits nothing
  absl::MutexLock l(&commit_mu_);
  absl::Status st = unsynced_commit_error_;
  unsynced_commit_error_ = absl::OkStatus();
  return st;
}

absl::Status NvmeTier::Put(const ObjectKey& id, std::span<const uint8_t> bytes,
                           const TierPutOptions& options) {
  if (options.header == nullptr) {
    auto hdr = codec::ParseHeader(bytes);
    if (!hdr.ok()) return absl::InvalidArgumentError(hdr.status().message());
  }
  const uint64_t hdr_ck = LoadLE<uint64_t>(bytes.data() + codec::kOffHeaderChecksum);
  const uint64_t len = bytes.size();
  uint64_t offset;
  {
    absl::MutexLock l(&mu_);
    while (writing_.contains(id)) writing_done_.Wait(&mu_);
    auto off = alloc_.Allocate(len);
    if (!off) {
      return TierFullError(absl::StrCat("nvme tier full: ", len, " bytes requested, ",
                                                       alloc_.used(), "/", capacity_, " used"));
    }
    offset = *off;
    extents_[offset] = Extent{len, 1};
    writing_.insert(id);
  }
  auto fail = [&](absl::Status st) {
    absl::MutexLock l(&mu_);
    writing_.erase(id);
    writing_done_.SignalAll();
    Unref(offset);
    return st;
  };
  BandwidthMeter::Op move = meter_.Start(/*write=*/true);
  // The write path only reads from `bytes`; BlockDevice takes a mutable
  // pointer because the same request type serves reads.
  absl::Status st = DoIo(IoRequest::Op::kWrite, offset, const_cast<uint8_t*>(bytes.data()), len);
  if (!st.ok()) return fail(st);
  auto commit = std::make_shared<PendingCommit>();
  commit->op = PendingCommit::Op::kPut;
  commit->key = IndexKey(id);
  commit->value = EncodeEntry(id.part, offset, len, hdr_ck);
  if (!options.sync) {
    // Publish now and queue the commit under mu_, so that an Erase of this
    // object queues its delete after this put.
    move.Done(len);
    absl::MutexLock l(&mu_);
    writing_.erase(id);
    writing_done_.SignalAll();
    commit->async = true;
    commit->id = id;
    commit->offset = offset;
    auto [eit, inserted] = entries_.try_emplace(id, Entry{offset, len, hdr_ck});
    if (!inserted) {
      commit->replaced = eit->second.offset;
      eit->second = Entry{offset, len, hdr_ck};
    }
    Enqueue(std::move(commit));
    return absl::OkStatus();
  }
  // Data durable before its index entry (both inside the group commit).
  st = EnqueueAndWait(std::move(commit));
  if (!st.ok()) return fail(st);
  move.Done(len);
  absl::MutexLock l(&mu_);
  writing_.erase(id);
  writing_done_.SignalAll();
  auto [eit, inserted] = entries_.try_emplace(id, Entry{offset, len, hdr_ck});
  if (!inserted) {
    uint64_t old = eit->second.offset;
    eit->second = Entry{offset, len, hdr_ck};
    Unref(old);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> NvmeTier::Size(const ObjectKey& id) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return absl::NotFoundError("not on nvme");
  return it->second.length;
}

absl::StatusOr<uint64_t> NvmeTier::OffsetOf(const ObjectKey& id) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return absl::NotFoundError("not on nvme");
  return it->second.offset;
}

absl::Status NvmeTier::DropEntry(const ObjectKey& id, uint64_t offset) {
  auto del = std::make_shared<PendingCommit>();
  del->op = PendingCommit::Op::kDelete;
  del->key = IndexKey(id);
  del->waited = true;
  {
    absl::MutexLock l(&mu_);
    auto it = entries_.find(id);
    // Another Put may have replaced the entry meanwhile; that one is fine.
    if (it == entries_.end() || it->second.offset != offset) return absl::OkStatus();
    entries_.erase(it);
    // Queued under mu_: after the commit of the Put that created the entry.
    Enqueue(del);
  }
  // Synced before the extent is reused, so the index never names another
  // object's bytes.
  absl::Status st;
  {
    absl::MutexLock l(&commit_mu_);
    commit_mu_.Await(absl::Condition(+[](PendingCommit* p) { return p->done; }, del.get()));
    st = del->result;
  }
  if (!st.ok()) return st;  // the extent stays allocated: the index still names it
  absl::MutexLock l(&mu_);
  Unref(offset);
  return absl::OkStatus();
}

absl::Status NvmeTier::Read(const ObjectKey& id, std::span<uint8_t> out) {
  Entry e;
  {
    absl::MutexLock l(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return absl::NotFoundError("not on nvme");
    e = it->second;
    ++extents_[e.offset].refs;
  }
  auto unref = [&] {
    absl::MutexLock l(&mu_);
    Unref(e.offset);
  };
  if (out.size() != e.length) {
    unref();
    return absl::InvalidArgumentError(
        absl::StrCat("buffer is ", out.size(), " bytes, object is ", e.length));
  }
  bool corrupt = false;
  absl::Status st = ReadEntry(id, e, out, &corrupt);
  unref();
  // DataLoss is what the caller must see either way.
  if (corrupt) (void)DropEntry(id, e.offset);
  return st;
}

absl::Status NvmeTier::ReadEntry(const ObjectKey& id, const Entry& e, std::span<uint8_t> out,
                                 bool* corrupt) {
  BandwidthMeter::Op move = meter_.Start(/*write=*/false);
  // The checksums are computed while later requests are still in flight.
  StreamingVerifier verifier(id, e.header_checksum, out);
  KVTIER_RETURN_IF_ERROR(DoIo(IoRequest::Op::kRead, e.offset, out.data(), e.length,
                              [&](uint64_t prefix) { verifier.Advance(prefix); }));
  move.Done(e.length);
  absl::Status st = verifier.Finish();
  *corrupt = !st.ok();
  return st;
}

std::vector<absl::Status> NvmeTier::ReadBatch(std::span<const ObjectKey> ids,
                                              std::span<const std::span<uint8_t>> outs) {
  const size_t n = ids.size();
  std::vector<absl::Status> result(n);
  if (outs.size() != n) {
    for (auto& r : result) r = absl::InvalidArgumentError("ids and buffers differ in number");
    return result;
  }
  // One object's part of the submission: its requests are reqs[first,
  // first + count), in object order, and `next` is the first of them not yet
  // part of the prefix reported to its verifier.
  struct Object {
    Entry e{};
    bool reading = false;
    uint64_t direct = 0;  // bytes read in place; the rest via `bounce`
    AlignedBuffer bounce;
    size_t first = 0, count = 0, next = 0;
    std::vector<bool> arrived;
    std::optional<StreamingVerifier> verifier;
  };
  std::vector<Object> objs(n);
  {
    absl::MutexLock l(&mu_);
    for (size_t i = 0; i < n; ++i) {
      auto it = entries_.find(ids[i]);
      if (it == entries_.end()) {
        result[i] = absl::NotFoundError("not on nvme");
        continue;
      }
      objs[i].e = it->second;
      objs[i].reading = true;
      ++extents_[it->second.offset].refs;
    }
  }
  std::vector<IoRequest> reqs;
  std::vector<uint32_t> owner;  // object of each request
  for (size_t i = 0; i < n; ++i) {
    Object& o = objs[i];
    if (!o.reading) continue;
    uint8_t* data = outs[i].data();
    const uint64_t len = o.e.length;
    if (outs[i].size() != len) {
      result[i] = absl::InvalidArgumentError(
          absl::StrCat("buffer is ", outs[i].size(), " bytes, object is ", len));
      continue;
    }
    const uint64_t rounded = (len + block_ - 1) / block_ * block_;
    if (reinterpret_cast<uintptr_t>(data) % block_ == 0) o.direct = len / block_ * block_;
    if (rounded > o.direct) {
      o.bounce = TakeBounce(rounded - o.direct);
      if (o.bounce.data() == nullptr) {
        result[i] = absl::ResourceExhaustedError("bounce buffer");
        continue;
      }
    }
    o.first = reqs.size();
    auto add = [&](uint8_t* buf, uint64_t dev_off, uint64_t bytes) {
      for (uint64_t done = 0; done < bytes; done += options_.max_io_bytes) {
        const uint64_t m = std::min<uint64_t>(options_.max_io_bytes, bytes - done);
        reqs.push_back(IoRequest{IoRequest::Op::kRead, dev_off + done, buf + done, m});
        owner.push_back(static_cast<uint32_t>(i));
      }
    };
    if (o.direct > 0) add(data, o.e.offset, o.direct);
    if (rounded > o.direct) add(o.bounce.data(), o.e.offset + o.direct, rounded - o.direct);
    o.count = reqs.size() - o.first;
    o.arrived.assign(o.count, false);
    o.verifier.emplace(ids[i], o.e.header_checksum, outs[i]);
  }
  BandwidthMeter::Op move = meter_.Start(/*write=*/false);
  absl::Status st = dev_->SubmitWithCompletions(reqs, [&](size_t r) {
    Object& o = objs[owner[r]];
    uint8_t* data = outs[owner[r]].data();
    const uint64_t len = o.e.length;
    const uint64_t start = reqs[r].offset - o.e.offset;
    if (start >= o.direct) std::memcpy(data + start, reqs[r].buf, std::min(reqs[r].len, len - start));
    o.arrived[r - o.first] = true;
    if (r - o.first != o.next) return;
    while (o.next < o.count && o.arrived[o.next]) ++o.next;
    o.verifier->Advance(o.next == o.count ? len : reqs[o.first + o.next].offset - o.e.offset);
  });
  uint64_t bytes_read = 0;
  std::vector<std::pair<ObjectKey, uint64_t>> corrupt;
  std::vector<size_t> unfinished;
  for (size_t i = 0; i < n; ++i) {
    Object& o = objs[i];
    if (!o.reading) continue;
    if (result[i].ok()) {
      if (o.next == o.count) {
        // Every request of the object arrived, whatever happened to others.
        bytes_read += o.e.length;
        result[i] = o.verifier->Finish();
        if (!result[i].ok()) corrupt.emplace_back(ids[i], o.e.offset);
      } else if (st.ok()) {
        result[i] = absl::InternalError("block device reported success without completing every read");
      } else {
        unfinished.push_back(i);
      }
    }
    if (o.bounce.data() != nullptr) ReturnBounce(std::move(o.bounce));
  }
  move.Done(bytes_read);
  // A failed submission names no request: the objects it did not finish are
  // read again one by one, so that each gets its own status (a short read at
  // the end of a truncated file is that object's DataLoss, not the batch's).
  for (size_t i : unfinished) {
    bool bad = false;
    result[i] = ReadEntry(ids[i], objs[i].e, outs[i], &bad);
    if (bad) corrupt.emplace_back(ids[i], objs[i].e.offset);
  }
  {
    absl::MutexLock l(&mu_);
    for (const Object& o : objs) {
      if (o.reading) Unref(o.e.offset);
    }
  }
  // DataLoss is what the callers see either way.
  for (const auto& [id, offset] : corrupt) (void)DropEntry(id, offset);
  return result;
}

absl::Status NvmeTier::Erase(const ObjectKey& id) {
  uint64_t offset;
  {
    absl::MutexLock l(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return absl::NotFoundError("not on nvme");
    offset = it->second.offset;
  }
  return DropEntry(id, offset);
}

std::vector<std::pair<ObjectKey, uint64_t>> NvmeTier::List() {
  absl::MutexLock l(&mu_);
  std::vector<std::pair<ObjectKey, uint64_t>> out;
  for (auto& [k, e] : entries_) out.emplace_back(k, e.length);
  return out;
}

}  // namespace kvtier::tiering
