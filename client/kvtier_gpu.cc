#include "client/kvtier_gpu.h"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/paged_codec.h"
#include "wire/chunk_check.h"

namespace kvtier::client {
namespace {

// Chunks a LayerwiseLoad holds and checks at once (each check spreads the
// chunk's layer records over the worker pool; the holds share the client's
// data-plane connections).
constexpr size_t kParallelHolds = 8;

// The block list of one entry point is checked once: that entry checks the
// ids against the cache (the span's host copy), and the launches under it
// get the span without that copy, so they check only its shape.
kernels::BlockSpan IdsChecked(kernels::BlockSpan span) {
  span.host_block_ids = nullptr;
  return span;
}

using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using DeviceGetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);

// A driver entry point through the runtime (libkvtier links no libcuda), by
// the CUDA 12.0 ABI; null if the driver lacks it.
void* DriverEntryPoint(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

// cuStreamWriteValue64 if the current device supports 64-bit stream memory
// operations, else null.
void* StreamWriteValue64() {
  auto get = reinterpret_cast<DeviceGetFn>(DriverEntryPoint("cuDeviceGet"));
  auto attribute = reinterpret_cast<DeviceGetAttributeFn>(DriverEntryPoint("cuDeviceGetAttribute"));
  void* write = DriverEntryPoint("cuStreamWriteValue64");
  int ordinal = 0;
  CUdevice device = 0;
  int can = 0;
  if (get == nullptr || attribute == nullptr || write == nullptr ||
      cudaGetDevice(&ordinal) != cudaSuccess || get(&device, ordinal) != CUDA_SUCCESS ||
      attribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != CUDA_SUCCESS) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return can != 0 ? write : nullptr;
}

// A little above the rate a PCIe 5.0 x16 copy engine moves, so that a
// waiter for a copy wakes before it ends rather than after.
constexpr double kCopyBytesPerSecond = 60e9;
// A store's kernels before its copy (gather and encode from HBM).
constexpr absl::Duration kEncodeTime = absl::Microseconds(30);
// How long before its expected end a wait stops sleeping and polls, and how
// long past it the polling goes on before the wait sleeps in the driver.
constexpr absl::Duration kWakeEarly = absl::Microseconds(150);
constexpr absl::Duration kPollPast = absl::Microseconds(150);

// Waits for `ev`, expected to complete at `expected` if nothing queued ahead
// of it: asleep until shortly before then, then polling, then (work ran late:
// the stream had other work first) in cudaEventSynchronize. A blocking
// cudaEventSynchronize alone wakes 0.1-0.3 ms after the event on an H200
// host, half of a chunk's copy; a spinning one keeps a core busy for the
// whole copy.
absl::Status AwaitEvent(cudaEvent_t ev, absl::Time expected, const char* what) {
  cudaError_t e = cudaEventQuery(ev);
  if (e == cudaErrorNotReady) {
    const absl::Time wake = expected - kWakeEarly;
    if (absl::Time now = absl::Now(); now < wake) absl::SleepFor(wake - now);
    const absl::Time give_up = std::max(absl::Now(), expected) + kPollPast;
    while ((e = cudaEventQuery(ev)) == cudaErrorNotReady && absl::Now() < give_up) {
      std::this_thread::yield();
    }
    if (e == cudaErrorNotReady) e = cudaEventSynchronize(ev);
  }
  return kernels::CudaStatus(e, what, __FILE__, __LINE__);
}

absl::Status Sync(cudaStream_t stream) {
  return kernels::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__,
                             __LINE__);
}

// The reader's check of a held chunk (CheckHeldBytes). On failure the daemon
// checks the stored chunk (and drops it if corrupt), and the result is
// DataLoss: the slots decoded from these bytes must not be used.
// Has the daemon check stored chunk `key` (and drop it if corrupt): a hold
// with `verify`, ended at once.
void AskDaemonToCheck(KvtierClient* client, const Hash128& key) {
  auto again = client->Hold(key, /*verify=*/true);
  if (again.ok()) (void)client->Unhold(*again);
}

// The answer to a chunk that failed the reader's check `checked` (on the
// host or on the device): the daemon checks the stored chunk, and DataLoss.
absl::Status ReaderCheckFailed(KvtierClient* client, const Hash128& key,
                               const absl::Status& checked) {
  AskDaemonToCheck(client, key);
  return absl::DataLossError(
      absl::StrCat("chunk ", key.ToHex(), " failed the reader's check: ", checked.message()));
}

absl::Status CheckHeld(KvtierClient* client, const Hash128& key, const HeldChunk& held) {
  absl::Status checked = CheckHeldBytes(held);
  if (checked.ok()) return checked;
  return ReaderCheckFailed(client, key, checked);
}

// The rest of the reader's check of a chunk whose records of `layers` the
// device hashed into `sums` (K's, then V's): each section's record table
// against the header, and the table's entries against the sums.
absl::Status CheckStagedSums(const codec::ChunkHeader& header, std::span<const uint8_t> chunk,
                             kernels::LayerRange layers, const uint64_t* sums) {
  const codec::ChunkLayout& l = header.layout;
  const uint32_t b = layers.begin, n = layers.End(l.geometry.num_layers) - b;
  for (codec::Section s : {codec::Section::kK, codec::Section::kV}) {
    const bool k = s == codec::Section::kK;
    const codec::SectionLayout& sec = k ? l.k : l.v;
    const uint64_t at = (k ? l.k_offset : l.v_offset) + sec.table_offset;
    KVTIER_RETURN_IF_ERROR(codec::CheckRecordTable(
        s, sec, k ? header.k_checksum : header.v_checksum,
        std::span<const uint64_t>(sums + (k ? 0 : n), n), chunk.subspan(at, sec.table_bytes), b));
  }
  return absl::OkStatus();
}

// Runs work(p) for every p in [0, n) on up to `threads` threads, and
// then_in_order(p) on the calling thread for p = 0, 1, ... as soon as work(p)
// has returned, so the in-order step overlaps the later work.
void ForEachThenInOrder(size_t n, size_t threads, const std::function<void(size_t)>& work,
                        const std::function<void(size_t)>& then_in_order) {
  absl::Mutex mu;
  std::vector<char> done(n, 0);
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  pool.reserve(std::min(n, threads));
  for (size_t w = 0; w < std::min(n, threads); ++w) {
    pool.emplace_back([&]() {
      for (size_t p = next.fetch_add(1); p < n; p = next.fetch_add(1)) {
        work(p);
        absl::MutexLock l(&mu);
        done[p] = 1;
      }
    });
  }
  for (size_t p = 0; p < n; ++p) {
    mu.LockWhen(absl::Condition(+[](char* c) { return *c != 0; }, &done[p]));
    mu.Unlock();
    then_in_order(p);
  }
  for (std::thread& t : pool) t.join();
}

}  // namespace

// ---- PendingStore ----

PendingStore::PendingStore(GpuPagedIo* io, const codec::ChunkSpec& spec,
                           const codec::ChunkLayout& layout, WritableSlot slot,
                           uint32_t* workspace, std::unique_ptr<kernels::HostStaging> staging)
    : io_(io),
      spec_(spec),
      layout_(layout),
      slot_(slot),
      workspace_(workspace),
      staging_(std::move(staging)) {}

PendingStore::~PendingStore() {
  if (header_landed_ != nullptr) cudaEventDestroy(header_landed_);
  if (slot_gone_) {
    if (done_ != nullptr) cudaEventDestroy(done_);
    return;
  }
  // Launches may still write into the slot: wait before giving it back
  // (after WaitEncoded none can).
  absl::Status st;
  if (!encoded_ && done_ != nullptr) {
    st = WaitDone();
  } else if (!encoded_ && (next_layer_ > 0 || broken_)) {
    st = Sync(stream_);
  }
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (workspace_ != nullptr) io_->ReturnWorkspace(workspace_, /*dirty=*/broken_ || !st.ok());
  // A buffer or slot that a kernel may still write is not reused: the buffer
  // is freed (cudaFree waits for the device), the slot stays allocated until
  // its lease ends.
  if (st.ok() && staging_ != nullptr) io_->ReturnStaging(std::move(staging_));
  if (st.ok()) (void)io_->client_->AbortSlot(slot_);
}

absl::Status PendingStore::WaitDone() const {
  return AwaitEvent(done_, done_expected_, "wait for the store's launches");
}

uint8_t* PendingStore::EncodeTarget() const {
  return staging_ != nullptr ? staging_->data() : const_cast<uint8_t*>(io_->Device(slot_.data.data()));
}

absl::Status PendingStore::EncodeLayers(const kernels::PagedKvLayout& cache,
                                        const kernels::BlockSpan& blocks,
                                        kernels::LayerRange layers, cudaStream_t stream) {
  if (slot_gone_ || broken_) return absl::FailedPreconditionError("the store was committed or failed");
  const uint32_t num_layers = spec_.geometry.num_layers;
  KVTIER_RETURN_IF_ERROR(kernels::ValidateLayerRange(layers, num_layers));
  if (layers.begin != next_layer_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers [", layers.begin, ", ", layers.End(num_layers),
                     ") do not continue the encoded layers [0, ", next_layer_, ")"));
  }
  KVTIER_RETURN_IF_ERROR(kernels::ValidateGatherEncode(spec_, cache, blocks, slot_.data.data(),
                                                       workspace_, layers));
  if (next_layer_ > 0 && stream != stream_) {
    // The workspace serves one launch at a time: order the new stream after the old.
    cudaEvent_t ev;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t e = cudaEventRecord(ev, stream_);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, ev, 0);
    cudaEventDestroy(ev);
    KVTIER_CUDA_RETURN_IF_ERROR(e);
  }
  stream_ = stream;
  absl::Status st = kernels::GatherEncode(spec_, cache, IdsChecked(blocks), layers,
                                          EncodeTarget(), workspace_, stream);
  const bool last = layers.End(num_layers) == num_layers;
  // The whole chunk, header included (a later range's launch may set its
  // flags), by the copy engine: in landing groups where the commit can use
  // them (landing_layers), else in one copy.
  if (st.ok() && staging_ != nullptr && last) {
    landing_layers_ = may_land_ && reinterpret_cast<uintptr_t>(slot_.data.data()) % 8 == 0
                          ? io_->landing_layers(layout_)
                          : 0;
    if (landing_layers_ != 0) {
      st = EnqueueLandingCopy(stream);
    } else {
      st = kernels::CudaStatus(cudaMemcpyAsync(slot_.data.data(), staging_->data(),
                                               slot_.data.size(), cudaMemcpyDeviceToHost, stream),
                               "copy the encoded chunk into the slot", __FILE__, __LINE__);
    }
  }
  if (st.ok() && last) {
    // What Commit waits for: this store's work, not what the caller enqueues
    // after it (an engine's next kernels, the next store of a batch). A
    // blocking event: the waiting thread sleeps instead of spinning a core
    // that the engine's threads may need.
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
    if (e == cudaSuccess) {
      e = cudaEventRecord(ev, stream);
      if (e == cudaSuccess) {
        done_ = ev;
        done_expected_ = absl::Now() + kEncodeTime +
                         absl::Seconds(static_cast<double>(slot_.data.size()) / kCopyBytesPerSecond);
      } else {
        cudaEventDestroy(ev);
      }
    }
    st = kernels::CudaStatus(e, "record the store's event", __FILE__, __LINE__);
  }
  if (!st.ok()) {
    broken_ = true;  // part of the chunk may be written, the workspace dirty
    return st;
  }
  next_layer_ = layers.End(num_layers);
  return absl::OkStatus();
}

absl::Status PendingStore::WaitEncoded() {
  if (encoded_) return absl::OkStatus();
  if (slot_gone_ || broken_) return absl::FailedPreconditionError("the store was committed or failed");
  if (next_layer_ != spec_.geometry.num_layers) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layers [", next_layer_, ", ", spec_.geometry.num_layers, ") were not encoded"));
  }
  // Recorded after the last launch, on a stream that follows every earlier one.
  absl::Status st = WaitDone();
  if (!st.ok()) {
    broken_ = true;
    return st;
  }
  io_->ReturnWorkspace(workspace_, /*dirty=*/false);
  workspace_ = nullptr;
  if (staging_ != nullptr) io_->ReturnStaging(std::move(staging_));
  cudaEventDestroy(done_);
  done_ = nullptr;
  encoded_ = true;
  return absl::OkStatus();
}

absl::Status PendingStore::EnqueueLandingCopy(cudaStream_t stream) {
  const codec::ChunkLayout& l = layout_;
  const auto write = reinterpret_cast<WriteValue64Fn>(io_->write_value64_);
  uint8_t* const dst = slot_.data.data();
  const uint8_t* const src = staging_->data();
  auto copy = [&](uint64_t from, uint64_t to) {
    return kernels::CudaStatus(
        cudaMemcpyAsync(dst + from, src + from, to - from, cudaMemcpyDeviceToHost, stream),
        "copy the encoded chunk into the slot", __FILE__, __LINE__);
  };
  // The header (and any padding before K's first record), which the commit
  // waits for.
  KVTIER_RETURN_IF_ERROR(copy(0, l.k_offset));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&header_landed_, cudaEventDisableTiming));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(header_landed_, stream));
  const uint32_t layers = l.geometry.num_layers;
  for (uint32_t s = 0; s < 2; ++s) {
    const codec::SectionLayout& sec = s == 0 ? l.k : l.v;
    const uint64_t base = s == 0 ? l.k_offset : l.v_offset;
    for (uint32_t a = 0; a < layers; a += landing_layers_) {
      const uint32_t b = std::min(layers, a + landing_layers_);
      // V's first group also carries the padding between the sections.
      const uint64_t from = s == 1 && a == 0 ? l.k_offset + l.k.bytes : base + sec.data_offset(a);
      KVTIER_RETURN_IF_ERROR(copy(from, base + sec.data_offset(b)));
      // The group's marker in its last layer's table entry, after its bytes
      // (the write's default flags fence the copy's writes before it).
      const uint8_t* entry = dst + base + sec.table_offset + 8 * uint64_t{b - 1};
      const CUresult r = write(
          stream, reinterpret_cast<CUdeviceptr>(io_->Device(entry)),
          wire::LandingMarker(slot_.id, static_cast<codec::Section>(s), b - 1),
          CU_STREAM_WRITE_VALUE_DEFAULT);
      if (r != CUDA_SUCCESS) {
        return absl::InternalError(absl::StrCat("cuStreamWriteValue64 failed: CUresult ", r));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PendingStore::CommitLanding(const Hash128& key, const PutOptions& options) {
  // The header is copied right after the encode, ahead of the records.
  KVTIER_RETURN_IF_ERROR(AwaitEvent(header_landed_, absl::Now(), "wait for the header to land"));
  PutOptions landing = options;
  landing.daemon_seals = true;
  landing.landing_layers = landing_layers_;
  return io_->client_->CommitSlot(slot_, key, landing);
}

absl::Status PendingStore::Commit(const Hash128& key, const PutOptions& options) {
  if (landing_layers_ != 0 && !encoded_ && !slot_gone_ && !broken_ &&
      next_layer_ == spec_.geometry.num_layers) {
    absl::Status landed = CommitLanding(key, options);
    if (landed.ok()) {
      // The device is past the chunk's last marker.
      absl::Status st = WaitEncoded();
      if (st.ok()) slot_gone_ = true;  // else the destructor frees what the device may use
      return st;
    }
    // The slot is still this store's: DeadlineExceeded (the copy ran late),
    // InvalidArgument from a daemon without landing commits, Unimplemented
    // over gRPC. Any other error is the commit's answer.
    if (!absl::IsDeadlineExceeded(landed) && !absl::IsInvalidArgument(landed) &&
        !absl::IsUnimplemented(landed)) {
      (void)WaitEncoded();
      return landed;  // the destructor aborts the slot if the daemon kept it
    }
  }
  KVTIER_RETURN_IF_ERROR(WaitEncoded());
  slot_gone_ = true;
  // The kernels wrote everything but the checksums, straight into the slot
  // (the header with its flags): the daemon computes them as it commits, in
  // its one pass over the chunk.
  PutOptions sealed = options;
  sealed.daemon_seals = true;
  return io_->client_->CommitSlot(slot_, key, sealed);
}

// ---- LayerwiseLoad ----

LayerwiseLoad::~LayerwiseLoad() {
  (void)Finish();
  for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  for (int h = 0; h < 2; ++h) {
    if (copied_[h] != nullptr) cudaEventDestroy(copied_[h]);
    if (free_[h] != nullptr) cudaEventDestroy(free_[h]);
  }
}

absl::Status LayerwiseLoad::WaitLayer(uint32_t layer, cudaStream_t stream) const {
  if (layer >= num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside [0, ", num_layers_, ")"));
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, LayerEvent(layer), 0));
  return absl::OkStatus();
}

void LayerwiseLoad::VerifyHeld() {
  for (size_t i = next_verify_.fetch_add(1); i < holds_.size(); i = next_verify_.fetch_add(1)) {
    if (!holds_[i].has_value()) continue;
    absl::Status st = CheckHeld(client_, keys_[i], *holds_[i]);
    if (!st.ok()) results_[i] = st;
  }
}

absl::Status LayerwiseLoad::Finish() {
  if (finished_) return absl::OkStatus();
  finished_ = true;
  for (std::thread& t : verifiers_) t.join();
  verifiers_.clear();
  absl::Status first;
  if (!events_.empty()) {
    first = kernels::CudaStatus(cudaEventSynchronize(events_.back()), "cudaEventSynchronize",
                                __FILE__, __LINE__);
  }
  if (!first.ok()) {
    // The kernels may still read the extents: keep them held (their leases
    // expire in the daemon) rather than let the daemon reuse them, and the
    // staging buffers unreturned.
    holds_.clear();
    for (auto& half : halves_) (void)half.release();
    sums_ = nullptr;
    return first;
  }
  if (!slabs_.empty()) CheckStaged();
  for (auto& half : halves_) {
    if (half != nullptr) io_->ReturnStaging(std::move(half));
  }
  if (sums_ != nullptr) io_->ReturnRecordSums(sums_, sums_count_);
  sums_ = nullptr;
  std::vector<HeldChunk> held;
  held.reserve(holds_.size());
  for (const std::optional<HeldChunk>& h : holds_) {
    if (h.has_value()) held.push_back(*h);
  }
  holds_.clear();
  // One data-plane call per connection that holds some, not one per chunk.
  if (!held.empty()) first = client_->UnholdBatch(held);
  return first;
}

// A staged layer-wise load's slabs: at most kSlabBytes of records (two are
// in device memory at once), and at least kSpanBytes of each chunk's
// records, so that a slab's copies, decodes and hashes are few and large
// (their events mark the span's layer groups at once).
constexpr uint64_t kSlabBytes = uint64_t{32} << 20;
constexpr uint64_t kSpanBytes = uint64_t{8} << 20;

absl::Status LayerwiseLoad::EnqueueStaged(const std::vector<codec::ChunkHeader>& headers,
                                          std::span<const PagedChunk> chunks,
                                          const kernels::PagedKvLayout& cache,
                                          cudaStream_t stream) {
  staged_headers_ = headers;
  const uint32_t groups = static_cast<uint32_t>(events_.size());
  // Groups a span: enough for kSpanBytes of the largest chunk's records.
  uint64_t widest = 1;
  for (size_t i = 0; i < holds_.size(); ++i) {
    if (!holds_[i]) continue;
    const codec::ChunkLayout& l = headers[i].layout;
    widest = std::max(widest, uint64_t{layer_group_} * (l.k.layer_stride + l.v.layer_stride));
  }
  const auto span_groups =
      static_cast<uint32_t>(std::clamp<uint64_t>(kSpanBytes / widest, 1, groups));
  // Slabs: per span, runs of held chunks with the same record strides, up to
  // kSlabBytes of records.
  for (uint32_t g0 = 0; g0 < groups; g0 += span_groups) {
    const uint32_t g1 = std::min(groups, g0 + span_groups);
    const uint32_t a = g0 * layer_group_, b = std::min(num_layers_, g1 * layer_group_);
    bool open = false;
    for (size_t i = 0; i < holds_.size(); ++i) {
      if (!holds_[i]) continue;
      const codec::ChunkLayout& l = headers[i].layout;
      const uint64_t bytes = uint64_t{b - a} * (l.k.layer_stride + l.v.layer_stride);
      bool joins = false;
      if (open) {
        const codec::ChunkLayout& f = headers[slabs_.back().chunks.front()].layout;
        joins = f.k.layer_stride == l.k.layer_stride && f.v.layer_stride == l.v.layer_stride &&
                (slabs_.back().chunks.size() + 1) * bytes <= kSlabBytes;
      }
      if (!joins) slabs_.push_back(Slab{g0, g1, a, b, {}, 0});
      open = true;
      slabs_.back().chunks.push_back(i);
    }
  }
  uint64_t most = 0;  // the largest slab's records + hash scratch
  for (Slab& slab : slabs_) {
    const codec::ChunkHeader& h = headers[slab.chunks.front()];
    const auto c = static_cast<uint32_t>(slab.chunks.size());
    const uint32_t n = slab.layer_end - slab.layer_begin;
    const uint64_t records = uint64_t{c} * n * (h.layout.k.layer_stride + h.layout.v.layer_stride);
    const uint64_t scratch =
        kernels::StagedRecordsWorkspaceBytes(h, {slab.layer_begin, slab.layer_end}, c);
    most = std::max(most, (records + 255) / 256 * 256 + scratch);
    slab.sums_at = sums_count_;
    sums_count_ += 2 * uint64_t{c} * n;
  }
  if (slabs_.empty()) {
    // Nothing held: the group events mark no decodes.
    for (cudaEvent_t ev : events_) KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, stream));
    return absl::OkStatus();
  }
  KVTIER_ASSIGN_OR_RETURN(sums_, io_->TakeRecordSums(sums_count_));
  for (int h = 0; h < 2; ++h) {
    KVTIER_ASSIGN_OR_RETURN(halves_[h], io_->TakeStaging(most));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&copied_[h], cudaEventDisableTiming));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&free_[h], cudaEventDisableTiming));
  }
  KVTIER_ASSIGN_OR_RETURN(cudaStream_t copy, io_->CopyStream());
  for (size_t s = 0; s < slabs_.size(); ++s) {
    const Slab& slab = slabs_[s];
    const uint32_t a = slab.layer_begin, b = slab.layer_end, n = b - a;
    const codec::ChunkHeader& first = headers[slab.chunks.front()];
    const uint64_t ks = first.layout.k.layer_stride, vs = first.layout.v.layer_stride;
    const auto c = static_cast<uint32_t>(slab.chunks.size());
    uint8_t* const k_base = halves_[s % 2]->data();
    uint8_t* const v_base = k_base + uint64_t{c} * n * ks;
    // The copy engine fills this half once the slab two back is done with it.
    if (s >= 2) KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy, free_[s % 2], 0));
    for (uint32_t j = 0; j < c; ++j) {
      const codec::ChunkLayout& l = headers[slab.chunks[j]].layout;
      const uint8_t* src = holds_[slab.chunks[j]]->data.data();
      KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(k_base + uint64_t{j} * n * ks,
                                                  src + l.k_offset + l.k.data_offset(a), n * ks,
                                                  cudaMemcpyHostToDevice, copy));
      KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(v_base + uint64_t{j} * n * vs,
                                                  src + l.v_offset + l.v.data_offset(a), n * vs,
                                                  cudaMemcpyHostToDevice, copy));
    }
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied_[s % 2], copy));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, copied_[s % 2], 0));
    for (uint32_t j = 0; j < c; ++j) {
      const size_t i = slab.chunks[j];
      KVTIER_RETURN_IF_ERROR(kernels::DecodeStagedScatter(
          headers[i],
          kernels::StagedRecords{k_base + uint64_t{j} * n * ks, v_base + uint64_t{j} * n * vs,
                                 {a, b}, 1},
          cache, IdsChecked(chunks[i].blocks), stream));
    }
    if (s + 1 == slabs_.size() || slabs_[s + 1].group_begin != slab.group_begin) {
      for (uint32_t g = slab.group_begin; g < slab.group_end; ++g) {
        KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[g], stream));
      }
    }
    const uint64_t records = uint64_t{c} * n * (ks + vs);
    KVTIER_RETURN_IF_ERROR(kernels::HashStagedRecords(
        first, kernels::StagedRecords{k_base, v_base, {a, b}, c},
        k_base + (records + 255) / 256 * 256, sums_ + slab.sums_at, stream));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(free_[s % 2], stream));
  }
  // Finish waits for the last event: the hashes after the last decodes.
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_.back(), stream));
  return absl::OkStatus();
}

void LayerwiseLoad::CheckStaged() {
  // Each staged chunk's checksums, K's layers then V's, gathered from its slabs.
  std::vector<std::vector<uint64_t>> computed(holds_.size());
  for (const Slab& slab : slabs_) {
    const uint32_t a = slab.layer_begin, n = slab.layer_end - a;
    const size_t c = slab.chunks.size();
    for (size_t j = 0; j < c; ++j) {
      std::vector<uint64_t>& mine = computed[slab.chunks[j]];
      mine.resize(2 * size_t{num_layers_});
      for (uint32_t r = 0; r < n; ++r) {
        mine[a + r] = sums_[slab.sums_at + j * n + r];
        mine[num_layers_ + a + r] = sums_[slab.sums_at + c * n + j * n + r];
      }
    }
  }
  for (size_t i = 0; i < holds_.size(); ++i) {
    if (!holds_[i] || computed[i].empty()) continue;
    io_->chunks_checked_on_device_.fetch_add(1, std::memory_order_relaxed);
    absl::Status st = CheckStagedSums(staged_headers_[i], holds_[i]->data,
                                      kernels::LayerRange{}, computed[i].data());
    if (!st.ok()) results_[i] = ReaderCheckFailed(client_, keys_[i], st);
  }
}

// ---- GpuPagedIo ----

absl::StatusOr<std::unique_ptr<GpuPagedIo>> GpuPagedIo::Create(KvtierClient* client) {
  std::span<uint8_t> pool = client->mapped_pool();
  if (pool.empty()) {
    return absl::FailedPreconditionError(
        "the GPU path needs the daemon's shared-memory pool (Unix socket, shared_memory on)");
  }
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaHostRegister(pool.data(), pool.size(), cudaHostRegisterMapped | cudaHostRegisterPortable));
  void* dev = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&dev, pool.data(), 0);
  if (e != cudaSuccess) {
    cudaHostUnregister(pool.data());
    return kernels::CudaStatus(e, "map the pool for the device", __FILE__, __LINE__);
  }
  std::unique_ptr<GpuPagedIo> io(new GpuPagedIo(client, pool, static_cast<uint8_t*>(dev)));
  io->write_value64_ = StreamWriteValue64();
  // Operators' switches for the stores' path (docs/engines.md).
  const char* stage = std::getenv("KVTIER_GPU_STAGE_STORES");
  if (stage != nullptr && std::string_view(stage) == "0") io->set_stage_stores(false);
  const char* landing = std::getenv("KVTIER_GPU_LANDING");
  io->set_landing(landing == nullptr || std::string_view(landing) != "0");
  const char* verify = std::getenv("KVTIER_GPU_VERIFY");
  if (verify != nullptr && std::string_view(verify) == "host") io->set_device_verify(false);
  return io;
}

uint32_t GpuPagedIo::landing_layers(const codec::ChunkLayout& l) const {
  // The daemon's markers are table entries: version 2, 8-byte aligned; the
  // copy leaves out the tables and nothing may follow V's.
  if (!landing_.load(std::memory_order_relaxed) || l.version < 2 ||
      l.v_offset + l.v.bytes != l.total_bytes || (l.k_offset + l.k.table_offset) % 8 != 0 ||
      (l.v_offset + l.v.table_offset) % 8 != 0 || l.geometry.num_layers == 0) {
    return 0;
  }
  const uint64_t stride = std::max<uint64_t>(1, std::min(l.k.layer_stride, l.v.layer_stride));
  const uint64_t piece = landing_piece_bytes_.load(std::memory_order_relaxed);
  const uint64_t group = (piece + stride - 1) / stride;
  return static_cast<uint32_t>(
      std::min<uint64_t>({group, l.geometry.num_layers, wire::kMaxLandingLayers}));
}

GpuPagedIo::~GpuPagedIo() {
  {
    // Queued commits use the workspaces and the mapping freed below.
    absl::MutexLock l(&commit_mu_);
    committers_.reset();
  }
  absl::MutexLock l(&ws_mu_);
  for (uint32_t* ws : all_workspaces_) cudaFree(ws);
  free_stagings_.clear();
  for (const auto& [sums, count] : free_record_sums_) cudaFreeHost(sums);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  cudaHostUnregister(pool_.data());
}

WorkerPool& GpuPagedIo::Committers() {
  absl::MutexLock l(&commit_mu_);
  // Each commit mostly waits (for the encodes, then for the daemon's seal).
  if (committers_ == nullptr) committers_ = std::make_unique<WorkerPool>(kStoreBatchCommits);
  return *committers_;
}

absl::StatusOr<uint32_t*> GpuPagedIo::TakeWorkspace() {
  {
    absl::MutexLock l(&ws_mu_);
    if (!free_workspaces_.empty()) {
      uint32_t* ws = free_workspaces_.back();
      free_workspaces_.pop_back();
      return ws;
    }
  }
  uint32_t* ws = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&ws), kernels::kGatherEncodeWorkspaceBytes));
  cudaError_t e = cudaMemset(ws, 0, kernels::kGatherEncodeWorkspaceBytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();  // the memset is on the legacy stream
  if (e != cudaSuccess) {
    cudaFree(ws);
    return kernels::CudaStatus(e, "clear a GatherEncode workspace", __FILE__, __LINE__);
  }
  absl::MutexLock l(&ws_mu_);
  all_workspaces_.push_back(ws);
  return ws;
}

void GpuPagedIo::ReturnWorkspace(uint32_t* ws, bool dirty) {
  absl::MutexLock l(&ws_mu_);
  if (!dirty) {
    free_workspaces_.push_back(ws);
    return;
  }
  all_workspaces_.erase(std::find(all_workspaces_.begin(), all_workspaces_.end(), ws));
  cudaFree(ws);
}

absl::StatusOr<std::unique_ptr<kernels::HostStaging>> GpuPagedIo::TakeStaging(size_t bytes) {
  std::unique_ptr<kernels::HostStaging> s;
  {
    absl::MutexLock l(&ws_mu_);
    if (!free_stagings_.empty()) {
      s = std::move(free_stagings_.back());
      free_stagings_.pop_back();
    }
  }
  if (s == nullptr) return kernels::HostStaging::Create(bytes);
  KVTIER_RETURN_IF_ERROR(s->Reserve(bytes));
  return s;
}

void GpuPagedIo::ReturnStaging(std::unique_ptr<kernels::HostStaging> staging) {
  absl::MutexLock l(&ws_mu_);
  free_stagings_.push_back(std::move(staging));
}

namespace {

// Record-sum buffers come in powers of two (at least one chunk's worth), so
// that the pool holds few sizes.
size_t RecordSumsCount(size_t count) {
  return std::bit_ceil(std::max(count, 2 * size_t{codec::kMaxLayers}));
}

}  // namespace

absl::StatusOr<uint64_t*> GpuPagedIo::TakeRecordSums(size_t count) {
  count = RecordSumsCount(count);
  {
    absl::MutexLock l(&ws_mu_);
    for (auto it = free_record_sums_.begin(); it != free_record_sums_.end(); ++it) {
      if (it->second == count) {
        uint64_t* sums = it->first;
        free_record_sums_.erase(it);
        return sums;
      }
    }
  }
  void* p = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&p, sizeof(uint64_t) * count, cudaHostAllocMapped | cudaHostAllocPortable));
  return static_cast<uint64_t*>(p);
}

void GpuPagedIo::ReturnRecordSums(uint64_t* sums, size_t count) {
  absl::MutexLock l(&ws_mu_);
  free_record_sums_.emplace_back(sums, RecordSumsCount(count));
}

absl::StatusOr<cudaStream_t> GpuPagedIo::CopyStream() {
  absl::MutexLock l(&ws_mu_);
  if (copy_stream_ == nullptr) {
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  }
  return copy_stream_;
}

absl::Status GpuPagedIo::InPool(std::span<const uint8_t> bytes) const {
  const auto at = reinterpret_cast<uintptr_t>(bytes.data());
  const auto base = reinterpret_cast<uintptr_t>(pool_.data());
  if (at >= base && bytes.size() <= pool_.size() && at - base <= pool_.size() - bytes.size()) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "the daemon's pool changed (kvtierd restarted): this GPU handle registered the old one; "
      "open a new one");
}

absl::StatusOr<codec::ChunkHeader> GpuPagedIo::HeldHeader(const Hash128& key,
                                                           const HeldChunk& held) const {
  KVTIER_RETURN_IF_ERROR(InPool(held.data));
  // Stored bytes whose header does not parse have rotted: DataLoss.
  auto header = ParseStoredHeader(held.data);
  if (!header.ok()) {
    return absl::DataLossError(
        absl::StrCat("chunk ", key.ToHex(), ": ", header.status().message()));
  }
  return header;
}

absl::StatusOr<std::unique_ptr<PendingStore>> GpuPagedIo::BeginStore(const codec::ChunkSpec& spec) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(spec));
  KVTIER_ASSIGN_OR_RETURN(uint32_t * ws, TakeWorkspace());
  auto slot = client_->AllocateSlot(layout.total_bytes);
  absl::Status st = slot.status();
  if (st.ok()) {
    st = InPool(slot->data);
    if (!st.ok()) (void)client_->AbortSlot(*slot);
  }
  if (!st.ok()) {
    ReturnWorkspace(ws, /*dirty=*/false);
    return st;
  }
  std::unique_ptr<kernels::HostStaging> staging;
  if (stage_stores_.load(std::memory_order_relaxed)) {
    auto s = TakeStaging(layout.total_bytes);
    if (s.ok()) {
      staging = *std::move(s);
    } else {
      // No device memory to spare: the kernels write the slot directly. The
      // failed allocation must not read as a later launch's error.
      (void)cudaGetLastError();
    }
  }
  return std::unique_ptr<PendingStore>(
      new PendingStore(this, spec, layout, *slot, ws, std::move(staging)));
}

absl::Status GpuPagedIo::Store(const Hash128& key, const codec::ChunkSpec& spec,
                               const kernels::PagedKvLayout& cache,
                               const kernels::BlockSpan& blocks, cudaStream_t stream,
                               const PutOptions& options) {
  // Checked before a slot is taken: a mismatch allocates nothing.
  alignas(16) const uint8_t probe_dst[16] = {};
  const uint32_t probe_ws = 0;
  KVTIER_RETURN_IF_ERROR(kernels::ValidateGatherEncode(spec, cache, blocks, probe_dst, &probe_ws));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<PendingStore> pending, BeginStore(spec));
  KVTIER_RETURN_IF_ERROR(
      pending->EncodeLayers(cache, IdsChecked(blocks), kernels::LayerRange{}, stream));
  return pending->Commit(key, options);
}

std::vector<absl::Status> GpuPagedIo::StoreBatch(std::span<const PagedChunk> chunks,
                                                 const codec::ChunkSpec& spec,
                                                 const kernels::PagedKvLayout& cache,
                                                 cudaStream_t stream, const PutOptions& options) {
  std::vector<absl::Status> out(chunks.size());
  std::deque<std::pair<size_t, std::unique_ptr<PendingStore>>> encoded;
  WorkerPool& committers = Committers();
  absl::Mutex mu;
  size_t committing = 0;  // this call's commits in flight, guarded by mu
  // The oldest chunk's device work is waited for here (its staging buffer
  // then serves the next encode); its commit goes to the commit threads.
  auto commit_oldest = [&] {
    const size_t i = encoded.front().first;
    std::unique_ptr<PendingStore> pending = std::move(encoded.front().second);
    encoded.pop_front();
    out[i] = pending->WaitEncoded();
    if (!out[i].ok()) return;
    mu.LockWhen(absl::Condition(
        +[](size_t* n) { return *n < kStoreBatchCommits; }, &committing));
    ++committing;
    mu.Unlock();
    committers.Schedule([&, i, pending = std::move(pending)]() mutable {
      absl::Status st = pending->Commit(chunks[i].key, options);
      pending.reset();  // no device call: WaitEncoded gave everything back
      absl::MutexLock l(&mu);
      out[i] = std::move(st);
      --committing;
    });
  };
  alignas(16) const uint8_t probe_dst[16] = {};
  const uint32_t probe_ws = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (encoded.size() == kStoreBatchDepth) commit_oldest();
    // Checked before a slot is taken, as in Store.
    out[i] = kernels::ValidateGatherEncode(spec, cache, chunks[i].blocks, probe_dst, &probe_ws);
    if (!out[i].ok()) continue;
    auto pending = BeginStore(spec);
    if (!pending.ok()) {
      out[i] = pending.status();
      continue;
    }
    (*pending)->may_land_ = false;
    out[i] = (*pending)->EncodeLayers(cache, IdsChecked(chunks[i].blocks),
                                      kernels::LayerRange{}, stream);
    if (out[i].ok()) encoded.emplace_back(i, *std::move(pending));
  }
  while (!encoded.empty()) commit_oldest();
  mu.LockWhen(absl::Condition(+[](size_t* n) { return *n == 0; }, &committing));
  mu.Unlock();
  return out;
}

absl::StatusOr<Tier> GpuPagedIo::Load(const Hash128& key, const kernels::PagedKvLayout& cache,
                                      const kernels::BlockSpan& blocks, cudaStream_t stream,
                                      kernels::LayerRange layers) {
  bool verify = false;
  for (;;) {
    KVTIER_ASSIGN_OR_RETURN(HeldChunk held, client_->Hold(key, verify));
    // The header is checked before the launch (it sizes every read); the
    // records after or while the kernel decodes them.
    auto header = HeldHeader(key, held);
    if (!header.ok()) {
      (void)client_->Unhold(held);
      // A rotted header: the daemon checks the stored chunk (and drops it).
      if (!absl::IsDataLoss(header.status()) || verify) return header.status();
      verify = true;
      continue;
    }
    // The staging buffer: the chunk's bytes, then the device check's
    // scratch (kernels::StagedRecordsWorkspaceBytes).
    const codec::ChunkLayout& l = header->layout;
    const bool device_check = !held.checked && device_verify_.load(std::memory_order_relaxed) &&
                              l.version >= 2 &&
                              kernels::ValidateLayerRange(layers, l.geometry.num_layers).ok();
    const uint64_t scratch_at = (held.data.size() + 255) / 256 * 256;
    const uint64_t scratch =
        device_check ? kernels::StagedRecordsWorkspaceBytes(*header, layers) : 0;
    auto staging = TakeStaging(scratch_at + scratch);
    if (!staging.ok()) {
      (void)client_->Unhold(held);
      return staging.status();
    }
    kernels::StagedRecords staged;
    absl::Status st = kernels::DecodeScatter(*header, Device(held.data.data()), cache, blocks,
                                             layers, **staging, stream,
                                             kernels::PriorKernel::kUnknown, &staged);
    if (!st.ok()) {
      // A launch that failed after its copy was enqueued: the copy may still
      // read the extent (and write the staging buffer, which is dropped).
      if (!absl::IsInvalidArgument(st)) (void)Sync(stream);
      (void)client_->Unhold(held);
      return st;
    }
    // The reader's check: of the staged bytes the decode reads, on the
    // device, where it takes them; else on the host while the device works.
    uint64_t* sums = nullptr;
    if (device_check && staged.k_records != nullptr && kernels::CanHashOnDevice(*header, staged)) {
      auto taken = TakeRecordSums();
      if (taken.ok() && kernels::HashStagedRecords(*header, staged, (*staging)->data() + scratch_at,
                                                   *taken, stream)
                            .ok()) {
        sums = *taken;
      } else if (taken.ok()) {
        ReturnRecordSums(*taken);
      }
    }
    absl::Status checked = sums == nullptr ? CheckHeldBytes(held) : absl::OkStatus();
    st = Sync(stream);
    if (sums != nullptr) {
      if (st.ok()) checked = CheckStagedSums(*header, held.data, staged.layers, sums);
      ReturnRecordSums(sums);
      chunks_checked_on_device_.fetch_add(1, std::memory_order_relaxed);
    }
    // The device is done with the extent; the daemon's answer is read at the
    // connection's next call.
    absl::Status u = client_->UnholdNoWait(held);
    if (!st.ok()) return st;
    ReturnStaging(*std::move(staging));
    if (checked.ok()) {
      if (!u.ok()) return u;
      return held.tier;
    }
    // The reader's check failed: the slots hold what the kernel made of the
    // bad bytes. The daemon checks the stored chunk (and drops it if corrupt).
    if (verify) {
      return absl::DataLossError(
          absl::StrCat("chunk ", key.ToHex(), " changed while read: ", checked.message()));
    }
    verify = true;
  }
}

absl::StatusOr<Tier> GpuPagedIo::AcceptHeld(const PagedChunk& chunk,
                                             const kernels::PagedKvLayout& cache,
                                             absl::StatusOr<HeldChunk> h,
                                             std::optional<HeldChunk>* held,
                                             codec::ChunkHeader* header) {
  if (!h.ok()) return h.status();
  // The header is checked before the launch (it sizes every read); the
  // records while or after the kernels decode them.
  auto parsed = HeldHeader(chunk.key, *h);
  absl::Status v = parsed.status();
  if (v.ok()) {
    *header = *parsed;
    v = kernels::ValidateDecodeScatter(*header, Device(h->data.data()), cache, chunk.blocks);
  }
  if (!v.ok()) {
    (void)client_->Unhold(*h);
    // A rotted header: the daemon checks the stored chunk (and drops it).
    if (absl::IsDataLoss(v)) AskDaemonToCheck(client_, chunk.key);
    return v;
  }
  *held = *h;
  return h->tier;
}

absl::StatusOr<std::unique_ptr<LayerwiseLoad>> GpuPagedIo::BeginLayerwiseLoad(
    std::span<const PagedChunk> chunks, const kernels::PagedKvLayout& cache,
    uint32_t layer_group, cudaStream_t stream) {
  if (chunks.empty()) return absl::InvalidArgumentError("no chunks to load");
  if (layer_group == 0) return absl::InvalidArgumentError("layer_group is 0");
  KVTIER_RETURN_IF_ERROR(kernels::ValidatePagedKvLayout(cache));
  const uint32_t groups = (cache.num_layers + layer_group - 1) / layer_group;
  std::unique_ptr<LayerwiseLoad> load(
      new LayerwiseLoad(this, client_, cache.num_layers, layer_group));
  load->events_.reserve(groups);
  for (uint32_t g = 0; g < groups; ++g) {
    cudaEvent_t ev;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    load->events_.push_back(ev);
  }

  // Hold every chunk and check its header, a few at a time over the
  // data-plane connections. The first layer group of chunk i is enqueued as
  // soon as chunks 0..i are held, so the copies overlap the later holds; the
  // sections are hashed after the launches (VerifyHeld), so the checks
  // overlap the decodes instead of preceding them.
  const size_t n = chunks.size();
  std::vector<std::optional<HeldChunk>> held(n);
  std::vector<codec::ChunkHeader> headers(n);
  std::vector<absl::StatusOr<Tier>> results(n, absl::UnknownError("not loaded"));
  auto accept = [&](size_t i, absl::StatusOr<HeldChunk> h) {
    results[i] = AcceptHeld(chunks[i], cache, std::move(h), &held[i], &headers[i]);
  };
  auto one = [&](size_t i) { accept(i, client_->Hold(chunks[i].key, /*verify=*/false)); };
  // Enqueues group by group; nothing here waits for the device. Every launch
  // after the first follows one of these decodes, which write no chunk: it
  // may start while that one finishes (kernels::PriorKernel).
  auto range_of = [&](uint32_t g) {
    return kernels::LayerRange{g * layer_group, std::min(cache.num_layers, (g + 1) * layer_group)};
  };
  absl::Status launch;
  kernels::PriorKernel prior = kernels::PriorKernel::kUnknown;
  auto decode = [&](size_t i, uint32_t g) {
    if (!held[i] || !launch.ok()) return;
    launch = kernels::DecodeScatter(headers[i], Device(held[i]->data.data()), cache,
                                    IdsChecked(chunks[i].blocks), range_of(g), stream, prior);
    prior = kernels::PriorKernel::kLeavesChunk;
  };
  // Holds the chunks of `round` on up to kParallelHolds threads and enqueues
  // the first layer group of each in order, as soon as it is held (the
  // staged form enqueues once every chunk is held).
  const bool try_staged = device_verify_.load(std::memory_order_relaxed);
  auto hold_round = [&](const std::vector<size_t>& round, bool enqueue) {
    ForEachThenInOrder(
        round.size(), kParallelHolds, [&](size_t p) { one(round[p]); },
        [&](size_t p) {
          if (enqueue) decode(round[p], 0);
        });
  };

  std::vector<size_t> round(n);
  std::iota(round.begin(), round.end(), size_t{0});
  if (try_staged) {
    // One data-plane call holds them all (threads of single holds where the
    // batch cannot: more than kMaxBatchKeys, a key twice, no data plane).
    std::vector<Hash128> keys;
    keys.reserve(n);
    for (const PagedChunk& c : chunks) keys.push_back(c.key);
    auto batch = n <= kMaxBatchKeys ? client_->HoldBatch(keys, /*verify=*/false)
                                    : absl::InvalidArgumentError("too many keys for one batch");
    if (batch.ok() && batch->size() == n) {
      for (size_t i = 0; i < n; ++i) accept(i, std::move((*batch)[i]));
    } else {
      hold_round(round, /*enqueue=*/false);
    }
    // The staged form takes every chunk held in one round whose records the
    // device hashes; else the chunks held go the direct way from here.
    bool stageable = true;
    for (size_t i : round) {
      stageable &= held[i] ? !held[i]->checked && kernels::CanHashOnDevice(
                                                       headers[i], {pool_.data(), pool_.data()})
                           : !absl::IsResourceExhausted(results[i].status());
    }
    if (stageable) {
      load->keys_.reserve(n);
      for (const PagedChunk& c : chunks) load->keys_.push_back(c.key);
      load->holds_ = held;
      load->results_ = std::move(results);
      absl::Status st = load->EnqueueStaged(headers, chunks, cache, stream);
      if (!st.ok()) {
        // Earlier copies and launches still read the holds and the buffers.
        auto copy = CopyStream();
        if (copy.ok()) (void)Sync(*copy);
        (void)Sync(stream);
        load->slabs_.clear();  // nothing to check: the load failed
        (void)load->Finish();
        return st;
      }
      return load;
    }
    for (size_t i : round) decode(i, 0);
  }
  for (bool first = true;; first = false) {
    if (!first || !try_staged) hold_round(round, /*enqueue=*/true);
    std::vector<size_t> refused;
    bool holds_some = false;
    for (size_t i : round) {
      holds_some |= held[i].has_value();
      if (!held[i] && absl::IsResourceExhausted(results[i].status())) refused.push_back(i);
    }
    if (refused.empty() || !holds_some || !launch.ok()) break;
    // kvtierd's hold limit (--max-holder-share, --max-held-share) refused
    // chunks while this load holds others: finish those (every layer group),
    // check and release them, then hold the refused ones again. The load
    // then runs in rounds, each one waited for; it fails a chunk only when
    // the limit refuses it while this load holds nothing.
    for (uint32_t g = 1; g < groups; ++g) {
      for (size_t i : round) decode(i, g);
    }
    if (launch.ok()) launch = Sync(stream);
    if (!launch.ok()) break;
    for (size_t i : round) {
      if (!held[i]) continue;
      absl::Status checked = CheckHeld(client_, chunks[i].key, *held[i]);
      if (!checked.ok()) results[i] = checked;
      (void)client_->Unhold(*held[i]);
      held[i].reset();
    }
    round = std::move(refused);
  }
  load->keys_.reserve(n);
  for (const PagedChunk& c : chunks) load->keys_.push_back(c.key);
  load->holds_ = held;  // `held` still serves the launches below
  load->results_ = std::move(results);
  for (uint32_t g = 0; g < groups && launch.ok(); ++g) {
    for (size_t i : round) {
      if (g > 0) decode(i, g);
    }
    if (launch.ok()) {
      launch = kernels::CudaStatus(cudaEventRecord(load->events_[g], stream), "cudaEventRecord",
                                   __FILE__, __LINE__);
    }
  }
  const size_t workers = std::min(n, kParallelHolds);
  // The reader's check of every held chunk, while the decodes run.
  LayerwiseLoad* const lw = load.get();
  for (size_t w = 0; w < workers; ++w) lw->verifiers_.emplace_back([lw] { lw->VerifyHeld(); });
  if (!launch.ok()) {
    (void)Sync(stream);  // earlier launches still read the holds
    (void)load->Finish();
    return launch;
  }
  return load;
}

}  // namespace kvtier::client
