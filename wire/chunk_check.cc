#include "wire/chunk_check.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include <immintrin.h>
#include <pthread.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "codec/section_hashes.h"
#include "common/hash.h"
#include "common/status.h"
#include "common/worker_pool.h"
#include "xxhash.h"

namespace kvtier::wire {

namespace {

using codec::SectionHashes;

// The step of a helper's hashing and of a pipelined copy.
constexpr size_t kPieceBytes = size_t{256} << 10;
// The step of a copy hashed on its own thread: the piece's source is still in
// L1/L2 when the hash reads it.
constexpr size_t kInlinePieceBytes = size_t{64} << 10;
// Below this a second thread costs more than it saves.
constexpr size_t kParallelMinBytes = size_t{2} << 20;
// The threads (the caller's included) a landing commit's seal takes: enough
// to hash a landed group of 2 MiB (GpuPagedIo's) before the next one lands.
constexpr size_t kLandingThreads = 8;
// Below this non-temporal stores are not worth their fence.
constexpr size_t kStreamMinBytes = size_t{4} << 10;

// Unaligned AVX2 loads, non-temporal 32-byte stores (the destination is
// aligned to 32 with a plain copy of its first bytes), and a software
// prefetch of the source 1 KiB ahead. glibc's memcpy of a few hundred KiB
// uses `rep movsb` and plain stores; on the Xeon of the H100 host this copy
// of 24 MiB is 1.1-1.4x faster than memcpy, and on AMD Zen `rep movsb` also
// runs at half speed when source and destination are not equally aligned
// (a pool slot is page aligned, a malloc'ed buffer 16 bytes past a page).
// No fence: the caller fences once after its last piece.
__attribute__((target("avx2"))) void StreamAvx2(uint8_t* d, const uint8_t* s, size_t n) {
  const size_t head = std::min<size_t>(n, (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 128 <= n; i += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(s + i + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s + i + 1088), _MM_HINT_T0);
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, n - i);
}

// One piece of a StreamCopy, unfenced.
void StreamPiece(uint8_t* d, const uint8_t* s, size_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n >= kStreamMinBytes) {
    StreamAvx2(d, s, n);
  } else {
    std::memcpy(d, s, n);
  }
}

// Makes this thread's non-temporal stores visible to every other core.
void StoreFence() { _mm_sfence(); }

absl::Status CheckLength(const codec::ChunkHeader& h, size_t size) {
  if (size != h.layout.total_bytes) {
    return absl::DataLossError(absl::StrCat("length: chunk is ", size, " bytes, header says ",
                                            h.layout.total_bytes));
  }
  return absl::OkStatus();
}

// The part of [lo, hi) inside [begin, begin + len), as (offset, length).
std::pair<size_t, size_t> Overlap(size_t lo, size_t hi, size_t begin, size_t len) {
  size_t a = std::max(lo, begin), b = std::min(hi, begin + len);
  return a < b ? std::make_pair(a, b - a) : std::make_pair(a, size_t{0});
}

// The checks of every section of `hashes` that [from, end) covers whole.
absl::Status CheckCovered(const SectionHashes& hashes, uint64_t from, uint64_t end) {
  for (size_t i = 0; i < hashes.num_sections(); ++i) {
    const SectionHashes::Range& r = hashes.section(i);
    if (r.begin < from || r.begin + r.bytes > end) continue;
    KVTIER_RETURN_IF_ERROR(hashes.Check(i));
  }
  return absl::OkStatus();
}

// Version 1: each section hashed whole, V on a pool thread when both are
// large enough to pay for it.
absl::Status CheckSectionsV1(const codec::ChunkHeader& h, std::span<const uint8_t> chunk) {
  const std::span<const uint8_t> sections[2] = {chunk.subspan(h.layout.k_offset, h.layout.k.bytes),
                                                chunk.subspan(h.layout.v_offset, h.layout.v.bytes)};
  const bool large = sections[0].size() >= kParallelMinBytes &&
                     sections[1].size() >= kParallelMinBytes;
  absl::Status st[2];
  WorkerPool::Shared().ParallelFor(
      2, [&](size_t s) { st[s] = codec::VerifySection(h, static_cast<codec::Section>(s), sections[s]); },
      large ? 2 : 1);
  return st[0].ok() ? st[1] : st[0];
}

// The record checksums of layers [begin, end) of both sections (K in
// out[0], V in out[1], indexed by layer), one task a record on the pool.
// REQUIRES: version 2; each out[s] holds num_layers entries.
void RecordChecksumsParallel(const codec::ChunkLayout& l,
                             const std::span<const uint8_t> (&sections)[2], uint32_t begin,
                             uint32_t end, std::vector<uint64_t> (&out)[2]) {
  WorkerPool::Shared().ParallelFor(2 * size_t{end - begin}, [&](size_t i) {
    const size_t s = i % 2;  // K and V interleaved
    const auto layer = static_cast<uint32_t>(begin + i / 2);
    out[s][layer] = codec::RecordChecksum(static_cast<codec::Section>(s), layer,
                                          codec::RecordBytes(s == 0 ? l.k : l.v, sections[s], layer));
  });
}

}  // namespace

absl::StatusOr<codec::VerifiedChunk> VerifyChunkParallel(std::span<const uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, codec::ParseHeader(chunk));
  KVTIER_RETURN_IF_ERROR(CheckLength(h, chunk.size()));
  if (h.layout.version < 2) return codec::AcceptChunk(h, chunk, CheckSectionsV1(h, chunk));
  return codec::AcceptChunk(h, chunk, CheckRecordsParallel(h, chunk, 0, h.layout.geometry.num_layers));
}

absl::Status CheckRecordsParallel(const codec::ChunkHeader& h, std::span<const uint8_t> chunk,
                                  uint32_t begin, uint32_t end) {
  const codec::ChunkLayout& l = h.layout;
  end = std::min(end, l.geometry.num_layers);
  if (begin >= end) return absl::OkStatus();
  std::vector<uint64_t> sums[2] = {std::vector<uint64_t>(l.geometry.num_layers),
                                   std::vector<uint64_t>(l.geometry.num_layers)};
  const std::span<const uint8_t> sections[2] = {chunk.subspan(l.k_offset, l.k.bytes),
                                                chunk.subspan(l.v_offset, l.v.bytes)};
  RecordChecksumsParallel(l, sections, begin, end, sums);
  for (int s = 0; s < 2; ++s) {
    const auto which = static_cast<codec::Section>(s);
    const codec::SectionLayout& sec = s == 0 ? l.k : l.v;
    const uint64_t want = s == 0 ? h.k_checksum : h.v_checksum;
    auto table = sections[s].subspan(sec.table_offset, sec.table_bytes);
    if (begin == 0 && end == l.geometry.num_layers) {
      KVTIER_RETURN_IF_ERROR(codec::CheckRecordTable(which, sec, want, sums[s], table));
      continue;
    }
    // Part of the layers: the table against the header, then those records.
    KVTIER_RETURN_IF_ERROR(codec::CheckRecordTableHeader(which, sec, want, table));
    for (uint32_t layer = begin; layer < end; ++layer) {
      KVTIER_RETURN_IF_ERROR(codec::CheckRecord(which, sec, sections[s], layer, sums[s][layer]));
    }
  }
  return absl::OkStatus();
}

namespace {

// The parsed, length-checked header of an unsealed chunk.
absl::StatusOr<codec::ChunkHeader> UnsealedHeader(std::span<const uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, codec::ParseUnsealedHeader(chunk));
  if (chunk.size() != h.layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("length: slot is ", chunk.size(),
                                                   " bytes, header says ", h.layout.total_bytes));
  }
  return h;
}

// Writes the record tables (version 2) and the header of `chunk` from the
// record checksums (version 2) or the section checksums (version 1), and
// returns it as sealed.
absl::StatusOr<codec::VerifiedChunk> FinishSeal(codec::ChunkHeader h, std::span<uint8_t> chunk,
                                                const std::vector<uint64_t> (&records)[2],
                                                uint64_t (&sums)[2]) {
  const codec::ChunkLayout& l = h.layout;
  if (l.version >= 2) {
    for (size_t s = 0; s < 2; ++s) {
      const codec::SectionLayout& sec = s == 0 ? l.k : l.v;
      const uint64_t at = (s == 0 ? l.k_offset : l.v_offset) + sec.table_offset;
      sums[s] = codec::WriteRecordTable(sec, records[s], chunk.subspan(at, sec.table_bytes));
    }
  }
  codec::WriteHeader(h.spec, l, sums[0], sums[1], chunk.first(codec::kHeaderSize));
  h.k_checksum = sums[0];
  h.v_checksum = sums[1];
  return codec::AcceptChunk(h, chunk, absl::OkStatus());
}

// Spins until the 8 bytes at `entry` read `want` (true), `stop` is set, or
// `deadline` passes (false; sets `stop`, so the other waiters give up too).
bool AwaitMarker(const uint8_t* entry, uint64_t want, absl::Time deadline,
                 std::atomic<bool>& stop) {
  const auto* word = reinterpret_cast<const uint64_t*>(entry);
  for (uint32_t i = 0;; ++i) {
    // The writer's device orders each group's bytes before its marker; the
    // acquire orders this thread's reads of the records after the marker.
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return true;
    if (stop.load(std::memory_order_relaxed)) return false;
    if ((i & 255) == 255) {
      if (absl::Now() > deadline) {
        stop.store(true);
        return false;
      }
      std::this_thread::yield();
    } else {
      _mm_pause();
    }
  }
}

}  // namespace

absl::StatusOr<codec::VerifiedChunk> SealChunkParallel(std::span<uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, UnsealedHeader(chunk));
  const codec::ChunkLayout& l = h.layout;
  const std::span<const uint8_t> sections[2] = {chunk.subspan(l.k_offset, l.k.bytes),
                                                chunk.subspan(l.v_offset, l.v.bytes)};
  uint64_t sums[2] = {0, 0};
  std::vector<uint64_t> records[2];
  if (l.version < 2) {
    WorkerPool::Shared().ParallelFor(2, [&](size_t s) { sums[s] = Checksum64(sections[s]); });
  } else {
    const uint32_t layers = l.geometry.num_layers;
    records[0].resize(layers);
    records[1].resize(layers);
    RecordChecksumsParallel(l, sections, 0, layers, records);
  }
  return FinishSeal(h, chunk, records, sums);
}

uint64_t LandingMarker(uint64_t slot_id, codec::Section section, uint32_t layer) {
  const uint64_t words[2] = {slot_id, (uint64_t{static_cast<uint8_t>(section)} << 32) | layer};
  return XXH3_64bits_withSeed(words, sizeof(words), 0x6c616e64 /* "land" */);
}

absl::StatusOr<codec::VerifiedChunk> SealLandedChunkParallel(std::span<uint8_t> chunk,
                                                             uint64_t slot_id, uint32_t group,
                                                             absl::Time deadline) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, UnsealedHeader(chunk));
  const codec::ChunkLayout& l = h.layout;
  const uint32_t layers = l.geometry.num_layers;
  if (l.version < 2) {
    return absl::InvalidArgumentError("a landing commit needs a version 2 chunk (record tables)");
  }
  if (group == 0 || group > layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("landing group of ", group, " layers; must be 1..", layers));
  }
  if (reinterpret_cast<uintptr_t>(chunk.data()) % 8 != 0) {
    return absl::InvalidArgumentError("a landing chunk must be 8-byte aligned");
  }
  const std::span<const uint8_t> sections[2] = {chunk.subspan(l.k_offset, l.k.bytes),
                                                chunk.subspan(l.v_offset, l.v.bytes)};
  std::vector<uint64_t> records[2] = {std::vector<uint64_t>(layers),
                                      std::vector<uint64_t>(layers)};
  std::atomic<bool> late{false};
  // In landing order (K, then V; layer by layer), so the tasks that wait
  // are the ones whose records come next. On at most kLandingThreads
  // threads: a commit whose bytes never land (its client died mid-copy)
  // keeps them spinning until the deadline, and the rest of the pool serves
  // the other commits.
  WorkerPool::Shared().ParallelFor(2 * size_t{layers}, [&](size_t i) {
    const size_t s = i / layers;
    const auto layer = static_cast<uint32_t>(i % layers);
    const auto which = static_cast<codec::Section>(s);
    const codec::SectionLayout& sec = s == 0 ? l.k : l.v;
    const uint32_t last = std::min(layers - 1, layer - layer % group + group - 1);
    const uint8_t* entry = sections[s].data() + sec.table_offset + 8 * uint64_t{last};
    if (!AwaitMarker(entry, LandingMarker(slot_id, which, last), deadline, late)) return;
    records[s][layer] = codec::RecordChecksum(which, layer, codec::RecordBytes(sec, sections[s], layer));
  }, kLandingThreads);
  if (late.load()) {
    return absl::DeadlineExceededError(
        absl::StrCat("slot ", slot_id, ": the chunk's records did not all land in time"));
  }
  uint64_t sums[2] = {0, 0};
  return FinishSeal(h, chunk, records, sums);
}

void StreamCopy(std::span<uint8_t> dst, std::span<const uint8_t> src) {
  for (size_t o = 0; o < src.size(); o += kPieceBytes) {
    StreamPiece(dst.data() + o, src.data() + o, std::min(kPieceBytes, src.size() - o));
  }
  StoreFence();
}

std::vector<std::pair<uint64_t, uint64_t>> PutCopyOrder(std::span<const uint8_t> chunk,
                                                        size_t piece_bytes) {
  std::vector<std::pair<uint64_t, uint64_t>> order;
  piece_bytes = std::max<size_t>(piece_bytes, 1);
  auto add = [&](uint64_t lo, uint64_t hi) {
    for (uint64_t o = lo; o < hi; o += piece_bytes) order.emplace_back(o, std::min(piece_bytes, hi - o));
  };
  auto h = codec::ParseHeader(chunk.first(std::min<size_t>(chunk.size(), codec::kHeaderSize)));
  if (!h.ok() || h->layout.total_bytes != chunk.size()) {
    add(0, chunk.size());
    return order;
  }
  const codec::ChunkLayout& l = h->layout;
  add(0, l.k_offset);
  // The section with the smaller share copied so far goes next:
  // k_done / k_bytes <= v_done / v_bytes, cross-multiplied.
  uint64_t k = 0, v = 0;
  const uint64_t kn = l.k.bytes, vn = l.v.bytes;
  while (k < kn || v < vn) {
    if (v >= vn || (k < kn && static_cast<unsigned __int128>(k) * vn <=
                                  static_cast<unsigned __int128>(v) * kn)) {
      const uint64_t n = std::min<uint64_t>(piece_bytes, kn - k);
      order.emplace_back(l.k_offset + k, n);
      k += n;
    } else {
      const uint64_t n = std::min<uint64_t>(piece_bytes, vn - v);
      order.emplace_back(l.v_offset + v, n);
      v += n;
    }
  }
  return order;
}

absl::StatusOr<codec::ChunkHeader> CopyVerified(std::span<uint8_t> dst,
                                                std::span<const uint8_t> src) {
  const size_t head = std::min<size_t>(src.size(), codec::kHeaderSize);
  std::memcpy(dst.data(), src.data(), head);
  // Parsed from the copy: the header that is checked is the one delivered.
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h,
                          codec::ParseHeader(std::span<const uint8_t>(dst.data(), head)));
  KVTIER_RETURN_IF_ERROR(CheckLength(h, src.size()));
  SectionHashes hashes;
  hashes.ResetChunk(h);
  for (size_t o = head; o < src.size(); o += kInlinePieceBytes) {
    const size_t n = std::min(kInlinePieceBytes, src.size() - o);
    StreamPiece(dst.data() + o, src.data() + o, n);
    hashes.Update(src.data(), o, o + n);
  }
  StoreFence();
  KVTIER_RETURN_IF_ERROR(CheckCovered(hashes, 0, src.size()));
  return h;
}

// How long Finish waits for the helper to finish the piece it is on.
constexpr auto kTakeOverWait = std::chrono::microseconds(200);

// One job's hashing, shared by the owner and the helper. The helper hashes
// bytes [hashed, ready) of `chunk` piece by piece, each piece while it holds
// `busy`; Finish sets `taken_over`, waits for the piece in progress, and
// hashes the rest itself. Dekker-style: `busy` and `taken_over` are
// sequentially consistent, so after the owner sees `busy` false the helper
// does not touch the states again in this job.
struct TrailingHasher::Job {
  absl::Mutex mu;
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
  bool stop ABSL_GUARDED_BY(mu) = false;
  // Written by the owner before it bumps `generation`, read by the helper
  // after it sees the new generation (ordered by `mu`).
  const uint8_t* chunk = nullptr;
  codec::ChunkHeader header;
  uint64_t from = 0, end = 0;
  SectionHashes hashes;
  uint64_t hashed = 0;  // owned by whoever holds `busy`, then by the owner
  std::atomic<uint64_t> ready{0};
  std::atomic<bool> busy{false}, taken_over{false};
  // False from when an owner starts a job until the helper has left it; an
  // owner that finds the helper still in an old job does without it.
  std::atomic<bool> idle{true};

  // Hashes [hashed, upto) into the states, a piece at a time.
  void HashUpTo(uint64_t upto) {
    while (hashed < upto) {
      const size_t n = std::min<size_t>(kPieceBytes, upto - hashed);
      hashes.Update(chunk, hashed, hashed + n);
      hashed += n;
    }
  }
};

TrailingHasher::TrailingHasher() : job_(std::make_unique<Job>()) {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "kvtier-check");
    Loop();
  });
}

TrailingHasher::~TrailingHasher() {
  job_->taken_over.store(true);
  {
    absl::MutexLock l(&job_->mu);
    job_->stop = true;
  }
  thread_.join();
}

void TrailingHasher::Loop() {
  Job& j = *job_;
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock l(&j.mu);
      auto next = [&j, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(j.mu) {
        return j.stop || j.generation != seen;
      };
      j.mu.Await(absl::Condition(&next));
      if (j.stop) return;
      seen = j.generation;
    }
    uint64_t hashed = j.hashed;  // j.hashed as of this thread's last piece
    for (;;) {
      // Waits for the next piece, or for the owner to take over.
      uint64_t c = 0;
      for (int i = 0;; ++i) {
        c = j.ready.load(std::memory_order_acquire);
        if (c > hashed || j.taken_over.load()) break;
        if (i < 4096) {
          _mm_pause();
        } else {
          std::this_thread::yield();
        }
      }
      j.busy.store(true);
      if (j.taken_over.load()) {
        j.busy.store(false);
        break;
      }
      j.HashUpTo(std::min<uint64_t>(c, hashed + kPieceBytes));
      hashed = j.hashed;
      j.busy.store(false);
    }
    j.idle.store(true, std::memory_order_release);
  }
}

bool TrailingHasher::Start(const uint8_t* chunk, const codec::ChunkHeader& h, uint64_t from,
                           uint64_t end) {
  Job& j = *job_;
  if (!j.idle.load(std::memory_order_acquire)) return false;
  absl::MutexLock l(&j.mu);
  j.chunk = chunk;
  j.header = h;
  j.from = from;
  j.end = end;
  j.hashes.ResetChunk(h);
  j.hashed = from;
  j.ready.store(from, std::memory_order_relaxed);
  j.taken_over.store(false);
  j.idle.store(false);
  ++j.generation;
  return true;
}

void TrailingHasher::Publish(uint64_t ready) { job_->ready.store(ready, std::memory_order_release); }

absl::Status TrailingHasher::Finish() {
  Job& j = *job_;
  j.taken_over.store(true);
  // A piece takes the helper tens of microseconds; if it does not finish it
  // within kTakeOverWait it was descheduled mid-piece, and this thread hashes
  // the whole job itself rather than wait for it to run again (the helper
  // finishes that piece later into states nobody reads).
  const auto give_up = std::chrono::steady_clock::now() + kTakeOverWait;
  while (j.busy.load()) {
    _mm_pause();
    if (std::chrono::steady_clock::now() > give_up) {
      SectionHashes fresh;
      fresh.ResetChunk(j.header);
      fresh.Update(j.chunk, j.from, j.end);
      // The helper may still be reading the chunk, whose memory is the
      // caller's once this returns: wait for it to leave its piece.
      WaitForHelperToLeavePiece();
      return CheckCovered(fresh, j.from, j.end);
    }
  }
  j.HashUpTo(j.end);
  return CheckCovered(j.hashes, j.from, j.end);
}

void TrailingHasher::Abandon() {
  job_->taken_over.store(true);
  WaitForHelperToLeavePiece();
}

void TrailingHasher::WaitForHelperToLeavePiece() {
  while (job_->busy.load()) std::this_thread::yield();
}

absl::StatusOr<codec::ChunkHeader> PipelinedCopyVerifier::CopyVerified(
    std::span<uint8_t> dst, std::span<const uint8_t> src) {
  if (!call_mu_.TryLock()) return wire::CopyVerified(dst, src);
  absl::StatusOr<codec::ChunkHeader> out = [&]() -> absl::StatusOr<codec::ChunkHeader> {
    const size_t head = std::min<size_t>(src.size(), codec::kHeaderSize);
    std::memcpy(dst.data(), src.data(), head);
    // Parsed from the copy: the header that is checked is the one delivered.
    KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h,
                            codec::ParseHeader(std::span<const uint8_t>(dst.data(), head)));
    KVTIER_RETURN_IF_ERROR(CheckLength(h, src.size()));
    if (!hasher_.Start(src.data(), h, head, src.size())) return wire::CopyVerified(dst, src);
    for (size_t o = head; o < src.size(); o += kPieceBytes) {
      const size_t n = std::min(kPieceBytes, src.size() - o);
      StreamPiece(dst.data() + o, src.data() + o, n);
      // After this piece's loads: the helper hashes what was copied.
      hasher_.Publish(o + n);
    }
    StoreFence();
    KVTIER_RETURN_IF_ERROR(hasher_.Finish());
    return h;
  }();
  call_mu_.Unlock();
  return out;
}

struct IncrementalChunkCheck::State {
  SectionHashes hashes;
  // Bytes final so far, from each section's start (after the header).
  uint64_t k_mark = 0, v_mark = 0;
  bool v_on_helper = false;
  bool finished = false;
};

IncrementalChunkCheck::IncrementalChunkCheck(std::span<const uint8_t> region,
                                             TrailingHasher* helper)
    : region_(region), helper_(helper), state_(new State) {}

IncrementalChunkCheck::~IncrementalChunkCheck() {
  if (state_->v_on_helper && !state_->finished) helper_->Abandon();
  delete state_;
}

uint64_t IncrementalChunkCheck::FinalBytes() const {
  if (!have_header_) return prefix_;
  return header_.layout.k_offset + state_->k_mark + state_->v_mark;
}

absl::Status IncrementalChunkCheck::Advance(uint64_t n) {
  if (n > region_.size() || n < last_advance_) {
    return absl::InvalidArgumentError(absl::StrCat("written_bytes ", n, " after ", last_advance_,
                                                   " in a slot of ", region_.size()));
  }
  last_advance_ = n;
  return MarkFinal(0, n);
}

absl::Status IncrementalChunkCheck::AdvanceRange(uint64_t offset, uint64_t length) {
  if (offset > region_.size() || length > region_.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat("written range [", offset, ", +", length,
                                                   ") beyond a slot of ", region_.size()));
  }
  return MarkFinal(offset, offset + length);
}

absl::Status IncrementalChunkCheck::MarkFinal(uint64_t lo, uint64_t hi) {
  State& s = *state_;
  if (!have_header_) {
    if (lo > prefix_) {
      return absl::InvalidArgumentError(absl::StrCat("bytes [", lo, ", ", hi,
                                                     ") final before the header: bytes [",
                                                     prefix_, ", ", lo, ") are not"));
    }
    prefix_ = std::max(prefix_, hi);
    if (prefix_ < codec::kHeaderSize) return absl::OkStatus();
    KVTIER_ASSIGN_OR_RETURN(header_, codec::ParseHeader(region_.first(codec::kHeaderSize)));
    KVTIER_RETURN_IF_ERROR(CheckLength(header_, region_.size()));
    have_header_ = true;
    s.hashes.ResetChunk(header_);
    const codec::ChunkLayout& l = header_.layout;
    s.v_on_helper = helper_ != nullptr && l.k.bytes >= kParallelMinBytes &&
                    l.v.bytes >= kParallelMinBytes &&
                    helper_->Start(region_.data(), header_, l.v_offset, l.v_offset + l.v.bytes);
    // What the prefix already covers counts as final in each section.
    lo = 0;
    hi = prefix_;
  }
  const codec::ChunkLayout& l = header_.layout;
  struct {
    const char* name;
    uint64_t begin, bytes;
    uint64_t* mark;
  } sections[] = {{"K", l.k_offset, l.k.bytes, &s.k_mark}, {"V", l.v_offset, l.v.bytes, &s.v_mark}};
  for (auto& sec : sections) {
    auto [o, n] = Overlap(lo, hi, sec.begin, sec.bytes);
    if (n == 0) continue;
    const uint64_t from = o - sec.begin, to = from + n;
    if (from > *sec.mark) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bytes [", o, ", ", o + n, ") of the ", sec.name, " section final before bytes [",
          sec.begin + *sec.mark, ", ", o, ")"));
    }
    if (to <= *sec.mark) continue;
    const uint64_t old = *sec.mark;
    *sec.mark = to;
    if (sec.mark == &s.v_mark && s.v_on_helper) {
      helper_->Publish(sec.begin + to);
      continue;
    }
    s.hashes.Update(region_.data(), sec.begin + old, sec.begin + to);
  }
  return absl::OkStatus();
}

absl::StatusOr<codec::VerifiedChunk> IncrementalChunkCheck::Finish() {
  State& s = *state_;
  if (!have_header_ || FinalBytes() != region_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("put committed after ", FinalBytes(), " of ",
                                                   region_.size(), " bytes"));
  }
  absl::Status sections = s.hashes.Check(SectionHashes::kK);
  if (s.v_on_helper) {
    absl::Status v = helper_->Finish();
    s.finished = true;
    if (sections.ok()) sections = v;
  } else if (sections.ok()) {
    sections = s.hashes.Check(SectionHashes::kV);
  }
  return codec::AcceptChunk(header_, region_, sections);
}

}  // namespace kvtier::wire
