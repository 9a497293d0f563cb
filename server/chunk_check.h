// Chunk checks of the shared-memory data plane, shared by kvtierd and
// libkvtier: a VerifyChunk that hashes the K and V sections on two threads
// (with common/hash.h Checksum64, libxxhash's dispatched XXH3-64), a copy that
// verifies the bytes it delivers in the same pass, and a check that follows a
// streamed write.
//
// Every function treats its input bytes as hostile, like codec/chunk.h, and
// answers with VerifyChunk's codes: InvalidArgument for a malformed header,
// DataLoss for a checksum or length mismatch.
#ifndef KVTIER_SERVER_CHUNK_CHECK_H_
#define KVTIER_SERVER_CHUNK_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "codec/chunk.h"

namespace kvtier::server {

// codec::VerifyChunk, with the V section hashed on a second thread when both
// sections are large enough to pay for it (the daemon's one pass over a
// chunk, at commit).
absl::StatusOr<codec::ChunkHeader> VerifyChunkParallel(std::span<const uint8_t> chunk);

// Copies `src` into `dst` in pieces of a few hundred KiB with plain stores,
// so that the bytes are still in cache for whoever reads them next (the
// daemon's check at commit). REQUIRES: dst.size() >= src.size().
void CopyInPieces(std::span<uint8_t> dst, std::span<const uint8_t> src);

// Copies the chunk `src` into `dst` and checks the copy: the header is
// parsed from the copied bytes and each piece is hashed right after it is
// copied, while it is in cache, so the check costs little beyond the copy and
// covers exactly the bytes delivered. REQUIRES: dst.size() >= src.size().
// On an error the contents of `dst` are unspecified.
absl::StatusOr<codec::ChunkHeader> CopyVerified(std::span<uint8_t> dst,
                                                std::span<const uint8_t> src);

// CopyVerified with the hashing moved to a helper thread that this object
// owns: the calling thread copies piece after piece (the same one-thread copy
// as CopyVerified), and the helper hashes each piece of `dst` as soon as it
// is copied, so the check overlaps the copy and adds about one piece's hash
// to it. Same contract and codes as CopyVerified. Thread-safe: one copy runs
// on the helper at a time; a caller that finds it busy runs CopyVerified on
// its own thread instead.
class PipelinedCopyVerifier {
 public:
  PipelinedCopyVerifier();
  ~PipelinedCopyVerifier();
  PipelinedCopyVerifier(const PipelinedCopyVerifier&) = delete;
  PipelinedCopyVerifier& operator=(const PipelinedCopyVerifier&) = delete;

  // REQUIRES: dst.size() >= src.size().
  absl::StatusOr<codec::ChunkHeader> CopyVerified(std::span<uint8_t> dst,
                                                  std::span<const uint8_t> src);

 private:
  struct Job;
  void Loop();

  absl::Mutex call_mu_;  // held by the caller whose copy the helper hashes
  std::unique_ptr<Job> job_;
  std::thread thread_;
};

// Checks a chunk while it is being written front to back (a streamed put):
// Advance(n) says the first n bytes of `region` are final and hashes what is
// new, so the check runs while the writer copies the next piece; Finish
// checks the checksums once the whole region is written. The chunk must fill
// `region` exactly. Not thread-safe (one stream).
class IncrementalChunkCheck {
 public:
  explicit IncrementalChunkCheck(std::span<const uint8_t> region);
  ~IncrementalChunkCheck();
  IncrementalChunkCheck(const IncrementalChunkCheck&) = delete;
  IncrementalChunkCheck& operator=(const IncrementalChunkCheck&) = delete;

  // InvalidArgument if n is beyond the region or below an earlier n, or for
  // a malformed header (checked once 128 bytes are final); DataLoss if the
  // header's length differs from the region's.
  absl::Status Advance(uint64_t n);
  // InvalidArgument if the region is not all final; DataLoss on a checksum
  // mismatch.
  absl::StatusOr<codec::ChunkHeader> Finish();

 private:
  struct State;
  std::span<const uint8_t> region_;
  uint64_t done_ = 0;    // bytes final so far
  uint64_t hashed_ = 0;  // bytes passed to the section hashes
  bool have_header_ = false;
  codec::ChunkHeader header_;
  State* state_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_CHUNK_CHECK_H_
