// Chunk checks of the shared-memory data plane, shared by kvtierd and
// libkvtier: a VerifyChunk and a SealChunk that spread a chunk's layer
// records over the shared worker pool (common/worker_pool.h; libxxhash's
// dispatched XXH3-64), a copy that verifies the bytes it delivers in the same
// pass, and a check that follows a streamed write.
//
// Every function treats its input bytes as hostile, like codec/chunk.h, and
// answers with VerifyChunk's codes: InvalidArgument for a malformed header,
// DataLoss for a checksum or length mismatch.
#ifndef KVTIER_WIRE_CHUNK_CHECK_H_
#define KVTIER_WIRE_CHUNK_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "codec/chunk.h"

namespace kvtier::wire {

// codec::VerifyChunk on the shared worker pool (common/worker_pool.h): a
// version 2 chunk's layer records one a task, a version 1 chunk's V section
// beside its K section when both are large enough to pay for it (the daemon's
// one pass over a chunk, at commit). The result is what a store takes
// (codec::VerifiedChunk).
absl::StatusOr<codec::VerifiedChunk> VerifyChunkParallel(std::span<const uint8_t> chunk);

// codec::SealChunk on the shared worker pool, then the chunk as sealed: the
// daemon's one pass over a chunk whose writer left the checksums to it (a
// GPU store). InvalidArgument for a malformed header or a length that is not
// the header's.
absl::StatusOr<codec::VerifiedChunk> SealChunkParallel(std::span<uint8_t> chunk);

// A sealed commit of a slot whose bytes are still landing (a GPU store's
// copy engine writes them while the daemon hashes, so that the commit ends
// about one record's hash after the copy instead of a whole chunk's hash
// after it). The writer promises, per section (K, then V) and per group of
// `group` consecutive layers (the last group may be shorter):
//   - the header lands before the commit is sent;
//   - once every record of a group is in the slot, the table entry of the
//     group's last layer holds LandingMarker(slot_id, section, that layer).
// A marker depends on the slot id, so what an earlier user of the same pool
// bytes left (a sealed table holds checksums) does not read as landed.
uint64_t LandingMarker(uint64_t slot_id, codec::Section section, uint32_t layer);
// The largest group (the commit frame carries it in a byte).
inline constexpr uint32_t kMaxLandingLayers = 255;

// SealChunkParallel of a chunk that lands as LandingMarker says: each record
// is hashed once its group's marker is in place (one record a task on
// WorkerPool::Shared(), on at most 8 threads; waiting tasks spin), then the
// tables and header are written as SealChunkParallel writes them. DeadlineExceeded when a marker is
// not there by `deadline` (nothing is written then; the writer may finish
// and commit the slot again); InvalidArgument for a malformed header, a
// length that is not the header's, a version 1 chunk, a group outside
// [1, layers] or a chunk that is not 8-byte aligned. A writer that breaks
// its promise (bytes written after their marker) gets a chunk whose checksums
// do not match its bytes: its readers find it DataLoss.
absl::StatusOr<codec::VerifiedChunk> SealLandedChunkParallel(std::span<uint8_t> chunk,
                                                             uint64_t slot_id, uint32_t group,
                                                             absl::Time deadline);

// Version 2: checks layer records [begin, end) of both sections of `chunk`
// (whose header `h` is, as ParseHeader parsed it from `chunk`), one record a
// task on WorkerPool::Shared(), and the record tables against the header.
// DataLoss as codec::VerifySection words it. A layer-wise reader checks each
// layer group just before it uses it. REQUIRES: h.layout.version >= 2,
// chunk.size() == h.layout.total_bytes.
absl::Status CheckRecordsParallel(const codec::ChunkHeader& h, std::span<const uint8_t> chunk,
                                  uint32_t begin, uint32_t end);

// Copies `src` into `dst` with non-temporal stores (AVX2 where the CPU has
// it; memcpy for small copies and elsewhere), then fences them. The bytes go
// to memory instead of into this core's cache: a copy that another core reads
// next (the daemon's check of a put) finds them there instead of snooping
// them out of this core, and the copy itself moves a third fewer bytes (no
// read for ownership). REQUIRES: dst.size() >= src.size().
void StreamCopy(std::span<uint8_t> dst, std::span<const uint8_t> src);

// The order in which a streamed put copies a chunk into its slot, as
// [offset, offset + length) pieces of at most `piece_bytes`: the header, then
// K and V pieces interleaved in proportion to the sections' sizes, so that a
// daemon hashing each section on its own thread sees both advance at once
// (IncrementalChunkCheck::AdvanceRange). A chunk whose header does not parse
// is copied front to back (the daemon rejects it either way).
std::vector<std::pair<uint64_t, uint64_t>> PutCopyOrder(std::span<const uint8_t> chunk,
                                                        size_t piece_bytes);

// Copies the chunk `src` into `dst` and checks the copy: the header is
// parsed from the copied bytes, and each piece is hashed from `src` right
// after it is copied, while it is still in this core's cache (the copy's
// stores go to memory, StreamCopy). Every byte delivered was read before the
// hash read it, so a byte of `src` that changes before its piece is copied is
// found; one that changes between the copy and the hash is reported as a
// mismatch although `dst` is whole (the reader then asks the daemon, which
// checks the stored bytes); only a byte changed and changed back within that
// window escapes. REQUIRES: dst.size() >= src.size(). On an error the
// contents of `dst` are unspecified.
absl::StatusOr<codec::ChunkHeader> CopyVerified(std::span<uint8_t> dst,
                                                std::span<const uint8_t> src);

// A helper thread that hashes a chunk's bytes behind a writer or a copier:
// the owner Starts a job over chunk bytes [from, end), Publishes how far the
// bytes are final, and Finishes, which hashes on the calling thread whatever
// the helper has not. A helper that is slow or not scheduled at all costs no
// more than hashing on the owner's thread. One job at a time, one owner per
// job (not thread-safe between owners).
class TrailingHasher {
 public:
  TrailingHasher();
  ~TrailingHasher();
  TrailingHasher(const TrailingHasher&) = delete;
  TrailingHasher& operator=(const TrailingHasher&) = delete;

  // Starts hashing the K and V section bytes of [from, end) of `chunk`
  // (laid out as `h` says). False, and no job, while the helper has not yet
  // left an earlier job (it was not scheduled since): the owner hashes
  // itself. REQUIRES: from <= end <= h.layout.total_bytes.
  bool Start(const uint8_t* chunk, const codec::ChunkHeader& h, uint64_t from, uint64_t end);
  // Bytes [from, ready) are final; the helper may read them.
  void Publish(uint64_t ready);
  // Ends the job and returns the verdict on every section that [from, end)
  // covers whole (SectionHashes::Check). REQUIRES: Publish(end) was called.
  absl::Status Finish();
  // Ends the job without a result, once the helper has left its current
  // piece: the chunk's memory is the caller's again when it returns (as it is
  // after Finish).
  void Abandon();

 private:
  struct Job;
  // Returns once the helper holds no piece of the current job (it reads the
  // job's chunk only while it holds one). REQUIRES: taken_over is set, so it
  // starts no new piece. A descheduled helper costs this wait its time to run
  // again; the caller may free the chunk's memory right after.
  void WaitForHelperToLeavePiece();
  void Loop();

  std::unique_ptr<Job> job_;
  std::thread thread_;
};

// CopyVerified with the hashing moved to a helper thread that this object
// owns: the calling thread copies piece after piece, and the helper hashes
// each piece of `src` as soon as it is copied (a TrailingHasher), so the
// check overlaps the copy and adds about one piece's hash to it. Same
// contract and codes as CopyVerified. Thread-safe: one copy runs on the
// helper at a time; a caller that finds it busy runs CopyVerified on its own
// thread instead.
class PipelinedCopyVerifier {
 public:
  PipelinedCopyVerifier() = default;

  // REQUIRES: dst.size() >= src.size().
  absl::StatusOr<codec::ChunkHeader> CopyVerified(std::span<uint8_t> dst,
                                                  std::span<const uint8_t> src);

 private:
  absl::Mutex call_mu_;  // held by the caller whose copy the helper hashes
  TrailingHasher hasher_;
};

// Checks a chunk while it is being written (a streamed put): Advance(n) says
// the first n bytes of `region` are final, AdvanceRange(offset, length) that
// those bytes are; each hashes what is new, so the check runs while the
// writer copies the next piece. The header must be final first (written
// front to back); after it, the K and V sections are each written front to
// back, in any interleaving (PutCopyOrder). Finish checks the checksums once
// the whole region is final. The chunk must fill `region` exactly. With a
// `helper`, the V section is hashed on it (when it is large enough to pay for
// a second thread) while the calling thread hashes K. Not thread-safe (one
// stream).
class IncrementalChunkCheck {
 public:
  explicit IncrementalChunkCheck(std::span<const uint8_t> region,
                                 TrailingHasher* helper = nullptr);
  ~IncrementalChunkCheck();
  IncrementalChunkCheck(const IncrementalChunkCheck&) = delete;
  IncrementalChunkCheck& operator=(const IncrementalChunkCheck&) = delete;

  // InvalidArgument if n is beyond the region or below an earlier n, or for
  // a malformed header (checked once 128 bytes are final); DataLoss if the
  // header's length differs from the region's.
  absl::Status Advance(uint64_t n);
  // InvalidArgument if the range is beyond the region, or leaves unwritten
  // bytes before it in the header or in its section; otherwise as Advance.
  absl::Status AdvanceRange(uint64_t offset, uint64_t length);
  // InvalidArgument if the region is not all final; DataLoss on a checksum
  // mismatch. On success, the region as a verified chunk.
  absl::StatusOr<codec::VerifiedChunk> Finish();

 private:
  struct State;
  absl::Status MarkFinal(uint64_t lo, uint64_t hi);
  uint64_t FinalBytes() const;

  std::span<const uint8_t> region_;
  TrailingHasher* helper_;
  uint64_t last_advance_ = 0;  // the largest n passed to Advance
  uint64_t prefix_ = 0;        // bytes final from 0, until the header is parsed
  bool have_header_ = false;
  codec::ChunkHeader header_;
  State* state_;
};

}  // namespace kvtier::wire

#endif  // KVTIER_WIRE_CHUNK_CHECK_H_
