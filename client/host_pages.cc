#include "client/host_pages.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "codec/chunk.h"
#include "common/status.h"

namespace kvtier::client {
namespace {

// The most threads one call starts.
constexpr size_t kMaxPageThreads = 64;

// Calls fn(i) for every i in [0, n) on the caller's thread and up to
// threads - 1 more (kMaxPageThreads in all), each taking the next index as
// it finishes one. Threads of the call's own, not WorkerPool::Shared(): a
// page blocks on the daemon's replies for part of its time, which that
// pool's short hashing tasks must not queue behind, and a prefetch must
// not wait for threads a concurrent backup holds.
void ForEachOnThreads(size_t n, size_t threads, absl::FunctionRef<void(size_t)> fn) {
  threads = std::min(threads, kMaxPageThreads);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> helpers;
  const size_t extra = std::min(std::max<size_t>(threads, 1), n) - std::min<size_t>(n, 1);
  helpers.reserve(extra);
  for (size_t t = 0; t < extra; ++t) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
}

absl::Status PutOne(KvtierClient& client, const codec::ChunkSpec& spec, uint64_t total,
                    const Hash128& key, const codec::KvRows<const uint16_t>& page) {
  if (!client.uses_shared_memory()) {
    std::vector<uint8_t> chunk(total);
    KVTIER_RETURN_IF_ERROR(codec::EncodeChunkRows(spec, page, chunk));
    return client.Put(key, chunk);
  }
  KVTIER_ASSIGN_OR_RETURN(WritableSlot slot, client.AllocateSlot(total));
  absl::Status st = codec::EncodeChunkRows(spec, page, slot.data, /*seal=*/false);
  if (!st.ok()) {
    (void)client.AbortSlot(slot);
    return st;
  }
  PutOptions sealed;
  sealed.daemon_seals = true;
  return client.CommitSlot(slot, key, sealed);
}

// The chunk's fields that a page of `expect` depends on.
absl::Status CheckExpected(const codec::ChunkSpec& expect, const codec::ChunkSpec& got) {
  codec::Geometry want = expect.geometry;
  want.block_size = got.geometry.block_size;
  if (got.fingerprint == expect.fingerprint && got.dtype == expect.dtype && got.geometry == want) {
    return absl::OkStatus();
  }
  const codec::Geometry& g = got.geometry;
  return absl::InvalidArgumentError(absl::StrCat(
      "chunk of model ", got.fingerprint.ToHex(), " ", codec::DTypeName(got.dtype), ", ",
      g.num_layers, " layers x ", g.num_tokens, " tokens x ", g.num_kv_heads, " heads x ",
      g.head_dim, " is not the page's (model ", expect.fingerprint.ToHex(), " ",
      codec::DTypeName(expect.dtype), ", ", want.num_layers, " x ", want.num_tokens, " x ",
      want.num_kv_heads, " x ", want.head_dim, ")"));
}

absl::Status DecodeInto(const codec::ChunkSpec& expect, std::span<const uint8_t> bytes,
                        const codec::KvRows<uint16_t>& page, bool verify) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader header, ParseStoredHeader(bytes));
  KVTIER_RETURN_IF_ERROR(CheckExpected(expect, header.spec));
  return codec::DecodeChunkRows(header, bytes, 0, header.spec.geometry.num_layers, page, verify);
}

absl::Status GetOne(KvtierClient& client, const codec::ChunkSpec& expect, const Hash128& key,
                    const codec::KvRows<uint16_t>& page, uint64_t* bytes) {
  if (!client.uses_shared_memory()) {
    // Get checks the checksums of what it copies.
    KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> chunk, client.Get(key));
    KVTIER_RETURN_IF_ERROR(DecodeInto(expect, chunk, page, /*verify=*/false));
    *bytes = chunk.size();
    return absl::OkStatus();
  }
  KVTIER_ASSIGN_OR_RETURN(HeldChunk held, client.Hold(key, /*verify=*/false));
  absl::Status st = DecodeInto(expect, held.data, page, /*verify=*/!held.checked);
  absl::Status unheld = client.Unhold(held);
  if (absl::IsDataLoss(st)) {
    // The daemon checks the stored bytes and drops a corrupt chunk.
    auto again = client.Hold(key, /*verify=*/true);
    if (!again.ok()) return again.status();
    (void)client.Unhold(*again);
    return absl::DataLossError(absl::StrCat("chunk changed while it was read: ", st.message()));
  }
  KVTIER_RETURN_IF_ERROR(st);
  *bytes = held.data.size();
  return unheld;
}

}  // namespace

HostPagesResult PutHostPages(KvtierClient& client, const codec::ChunkSpec& spec,
                             std::span<const Hash128> keys,
                             std::span<const codec::KvRows<const uint16_t>> pages, size_t threads) {
  HostPagesResult r;
  r.status.resize(pages.size());
  auto layout = codec::ValidateSpec(spec);
  if (!layout.ok()) {
    std::fill(r.status.begin(), r.status.end(), layout.status());
    return r;
  }
  std::atomic<uint64_t> bytes{0};
  ForEachOnThreads(pages.size(), threads, [&](size_t i) {
    r.status[i] = codec::ValidateRows(pages[i], spec.geometry);
    if (!r.status[i].ok()) return;
    r.status[i] = PutOne(client, spec, layout->total_bytes, keys[i], pages[i]);
    if (r.status[i].ok()) bytes.fetch_add(layout->total_bytes);
  });
  r.bytes = bytes.load();
  return r;
}

HostPagesResult GetHostPages(KvtierClient& client, const codec::ChunkSpec& expect,
                             std::span<const Hash128> keys,
                             std::span<const codec::KvRows<uint16_t>> pages, size_t threads) {
  HostPagesResult r;
  r.status.resize(pages.size());
  std::atomic<uint64_t> bytes{0};
  ForEachOnThreads(pages.size(), threads, [&](size_t i) {
    r.status[i] = codec::ValidateRows(pages[i], expect.geometry);
    if (!r.status[i].ok()) return;
    uint64_t n = 0;
    r.status[i] = GetOne(client, expect, keys[i], pages[i], &n);
    if (r.status[i].ok()) bytes.fetch_add(n);
  });
  r.bytes = bytes.load();
  return r;
}

}  // namespace kvtier::client
