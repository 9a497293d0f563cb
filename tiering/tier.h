// The one interface every tier implements (HBM, DRAM, NVMe, remote), and the
// identifiers the placement engine uses to name what a tier stores.
#ifndef KVTIER_TIERING_TIER_H_
#define KVTIER_TIERING_TIER_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "codec/chunk.h"
#include "common/hash.h"

namespace kvtier::tiering {

// Tiers from fastest to slowest; the numeric order is the demotion order.
enum class TierKind : uint8_t { kHbm = 0, kDram = 1, kNvme = 2, kRemote = 3 };
inline constexpr int kNumTierKinds = 4;
const char* TierName(TierKind kind);  // "hbm", "dram", "nvme", "remote"

// What a stored object holds. A chunk is stored whole, or split into a K
// object and a V object (split K/V placement). Each split object is the
// chunk's 128-byte header followed by one section, so it verifies alone
// (codec::VerifySection) and the chunk is reassembled by a byte copy.
enum class Part : uint8_t { kWhole = 0, kK = 1, kV = 2 };

// Name of one stored object: chunk key + part.
struct ObjectKey {
  Hash128 key;
  Part part = Part::kWhole;
  friend bool operator==(const ObjectKey&, const ObjectKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ObjectKey& k) {
    return H::combine(std::move(h), k.key, static_cast<uint8_t>(k.part));
  }
};

struct TierCapabilities {
  bool durable = false;          // survives a process crash (NVMe)
  bool shared_memory = false;    // bytes live in a region other processes can map (DRAM)
  bool device_memory = false;    // bytes live in GPU memory (HBM)
  bool verifies_on_read = false; // Read checks checksums and returns DataLoss
};

// Measured throughput: bytes moved divided by the time during which at least
// one move was in flight, accumulated since the tier opened. Moves that
// overlap (concurrent reads, a queue of requests) count their shared time
// once, so the figure is the tier's aggregate rate, not one request's. Zero
// until something was moved.
struct Bandwidth {
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
};

// Behind Tier::bandwidth(). Thread-safe.
class BandwidthMeter {
 public:
  // One read or write in flight, from Start to Done. Done(0), or destruction
  // without Done, is a failed move: no bytes, and its time counts only where
  // it overlapped moves that moved bytes.
  class Op {
   public:
    Op(const Op&) = delete;
    Op& operator=(const Op&) = delete;
    ~Op() { Done(0); }
    void Done(uint64_t bytes) {
      if (meter_ != nullptr) meter_->Finish(write_, bytes);
      meter_ = nullptr;
    }

   private:
    friend class BandwidthMeter;
    Op(BandwidthMeter* meter, bool write) : meter_(meter), write_(write) {}
    BandwidthMeter* meter_;
    bool write_;
  };

  Op Start(bool write);
  // A measurement made outside the tier's own traffic (a probe at open):
  // `bytes` moved in `micros` of busy time, added to the totals.
  void Add(bool write, uint64_t bytes, int64_t micros);
  Bandwidth Get() const;

 private:
  // Per direction. Busy time is counted up to the last Finish: from `since`
  // (the later of the first Start of a busy period and the last Finish) to
  // each Finish while moves are in flight.
  struct Direction {
    uint64_t bytes = 0;
    int64_t busy_us = 0;
    int in_flight = 0;
    int64_t since_us = 0;
  };
  void Finish(bool write, uint64_t bytes);

  mutable absl::Mutex mu_;
  Direction dir_[2] ABSL_GUARDED_BY(mu_);  // [0] reads, [1] writes
};

// Tiers mark "no room in this tier" errors with this payload, so the engine
// can tell them apart from a device's ENOSPC (which eviction cannot fix).
inline constexpr char kTierFullPayload[] = "kvtier.tiering/tier-full";
absl::Status TierFullError(std::string_view message);
bool IsTierFull(const absl::Status& status);

// Per-call options of Tier::Put.
struct TierPutOptions {
  // Return only once the object survives a crash (NVMe: data synced, then
  // its index entry committed). false: return once the object is readable;
  // a durable tier makes it durable in the background (NvmeTier::Flush waits
  // for it). Tiers that are not durable ignore it. Default: true
  bool sync = true;
  // The header of `bytes` as the caller already parsed and verified it
  // (codec::VerifiedChunk::header(); every object starts with its chunk's
  // header), so a tier that checks headers does not parse it again. Not
  // owned; read during the call only. Default: nullptr (a tier that checks
  // headers parses it)
  const codec::ChunkHeader* header = nullptr;
};

// Checks a stored object's bytes against the chunk format: a whole chunk with
// codec::VerifyChunk, a K or V part (header + one section) with
// codec::ParseHeader + codec::VerifySection. DataLoss on a checksum or length
// mismatch; InvalidArgument for a malformed header.
absl::Status VerifyObject(const ObjectKey& id, std::span<const uint8_t> bytes);

// A store of immutable byte objects with a hard capacity. Tiers never evict
// on their own: when full, Put fails with ResourceExhausted and the placement
// engine decides what to evict or demote. Thread-safe; implementations hold
// no lock while copying or doing I/O.
class Tier {
 public:
  virtual ~Tier() = default;

  virtual TierKind kind() const = 0;
  virtual TierCapabilities capabilities() const = 0;
  // Hard limit on used_bytes().
  virtual uint64_t capacity_bytes() const = 0;
  // Bytes allocated to objects (rounded to the tier's allocation unit) and to
  // reserved slots. Never above ready_bytes().
  virtual uint64_t used_bytes() const = 0;
  // The part of capacity_bytes() that can be allocated now. It is all of it
  // except while a tier makes its memory usable behind its Open (a DRAM
  // pool populated in the background, DramTierOptions::populate): then
  // it grows to capacity_bytes(), and a Put that finds no room in it fails
  // as a Put into a full tier does.
  virtual uint64_t ready_bytes() const { return capacity_bytes(); }
  virtual Bandwidth bandwidth() const = 0;

  // Stores `bytes` as object `id`, replacing an existing object of that id.
  // OK once the object is readable, and with options.sync once it is
  // durable on a durable tier (TierPutOptions). ResourceExhausted if there
  // is no room; other codes from the device.
  virtual absl::Status Put(const ObjectKey& id, std::span<const uint8_t> bytes,
                           const TierPutOptions& options) = 0;
  // Put with the default options (synced). Implementations bring it into
  // scope with `using Tier::Put;`.
  absl::Status Put(const ObjectKey& id, std::span<const uint8_t> bytes) {
    return Put(id, bytes, TierPutOptions{});
  }
  // Length of object `id`. NotFound if absent.
  virtual absl::StatusOr<uint64_t> Size(const ObjectKey& id) = 0;
  // Copies object `id` into `out`, which must be exactly Size() bytes
  // (InvalidArgument otherwise). NotFound if absent. DataLoss if the tier
  // detects corruption; the object is then dropped.
  virtual absl::Status Read(const ObjectKey& id, std::span<uint8_t> out) = 0;
  // Read of every object into the buffer beside it: one status per object,
  // as Read would return it, and checked as Read checks. InvalidArgument for
  // every object if the spans differ in number. Tiers that can keep many
  // reads in flight (NvmeTier) override it; this one reads them in turn.
  virtual std::vector<absl::Status> ReadBatch(std::span<const ObjectKey> ids,
                                              std::span<const std::span<uint8_t>> outs) {
    if (ids.size() != outs.size()) {
      return std::vector<absl::Status>(
          ids.size(), absl::InvalidArgumentError("ReadBatch: as many buffers as objects"));
    }
    std::vector<absl::Status> out;
    out.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) out.push_back(Read(ids[i], outs[i]));
    return out;
  }
  // Removes object `id`; its space is reused once no reader holds it.
  // NotFound if absent.
  virtual absl::Status Erase(const ObjectKey& id) = 0;
  // Every object with its length (the engine rebuilds its map of a durable
  // tier from this at startup).
  virtual std::vector<std::pair<ObjectKey, uint64_t>> List() = 0;
  // Waits until every Put that returned before the call is durable, and
  // returns the first error of a background commit since the previous Flush.
  // Tiers that make nothing durable in the background return OK at once.
  virtual absl::Status Flush() { return absl::OkStatus(); }
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_TIER_H_
