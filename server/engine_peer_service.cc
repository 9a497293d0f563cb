#include "server/engine_peer_service.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtier::server {

using tiering::ObjectKey;
using tiering::Part;
using tiering::PlacementEngine;

namespace {

absl::Status OnlyWholeChunks(const ObjectKey& id) {
  if (id.part != Part::kWhole) {
    return absl::InvalidArgumentError("cluster peers exchange whole chunks only");
  }
  return absl::OkStatus();
}

tiering::PutOptions ReplicaPutOptions(PlacementEngine* e) {
  tiering::PutOptions o;
  o.durable = e->nvme() != nullptr;  // a replica survives a restart of its owner
  o.replicate = false;               // it is already where it belongs
  return o;
}

// Receives into a DRAM-pool slot; commits it to the engine.
class SlotSink : public cluster::PeerService::PutSink {
 public:
  SlotSink(PlacementEngine* e, tiering::Slot slot, tiering::ObjectKey id)
      : e_(e), slot_(slot), id_(id) {}
  ~SlotSink() override {
    if (!done_) (void)e_->AbortSlot(slot_.id);
  }
  std::span<uint8_t> buffer() override {
    return {e_->dram()->base() + slot_.extent.offset, slot_.extent.length};
  }
  absl::Status Commit(bool ok) override {
    done_ = true;
    if (!ok) return e_->AbortSlot(slot_.id);
    return e_->CommitSlot(slot_.id, id_.key, ReplicaPutOptions(e_));
  }

 private:
  PlacementEngine* e_;
  tiering::Slot slot_;
  tiering::ObjectKey id_;
  bool done_ = false;
};

// Without a DRAM tier: a heap buffer, stored with Put.
class HeapSink : public cluster::PeerService::PutSink {
 public:
  HeapSink(PlacementEngine* e, ObjectKey id, uint64_t n) : e_(e), id_(id), buf_(n) {}
  std::span<uint8_t> buffer() override { return buf_; }
  absl::Status Commit(bool ok) override {
    if (!ok) return absl::OkStatus();
    return e_->Put(id_.key, buf_, ReplicaPutOptions(e_));
  }

 private:
  PlacementEngine* e_;
  ObjectKey id_;
  std::vector<uint8_t> buf_;
};

// A chunk in the DRAM pool (PlacementEngine::GetShared): pinned in place or
// copied into a scratch slot, let go when the transfer is done.
class SharedSource : public cluster::PeerService::GetSource {
 public:
  SharedSource(PlacementEngine* e, const tiering::SharedRead& r) : e_(e), r_(r) {}
  ~SharedSource() override {
    (void)(r_.lease_id != 0 ? e_->Release(r_.lease_id) : e_->AbortSlot(r_.slot_id));
  }
  std::span<const uint8_t> bytes() override { return r_.bytes; }

 private:
  PlacementEngine* e_;
  tiering::SharedRead r_;
};

class HeapSource : public cluster::PeerService::GetSource {
 public:
  explicit HeapSource(std::vector<uint8_t> b) : b_(std::move(b)) {}
  std::span<const uint8_t> bytes() override { return b_; }

 private:
  std::vector<uint8_t> b_;
};

}  // namespace

absl::StatusOr<PlacementEngine*> EnginePeerService::Engine() const {
  PlacementEngine* e = engine_.load();
  if (e == nullptr) return absl::UnavailableError("node is starting");
  return e;
}

absl::StatusOr<std::unique_ptr<cluster::PeerService::PutSink>> EnginePeerService::BeginPut(
    const ObjectKey& id, uint64_t bytes) {
  if (auto s = OnlyWholeChunks(id); !s.ok()) return s;
  auto e = Engine();
  if (!e.ok()) return e.status();
  if ((*e)->dram() != nullptr) {
    auto slot = (*e)->AllocateSlot(bytes);
    if (!slot.ok()) return slot.status();
    return std::unique_ptr<PutSink>(new SlotSink(*e, *slot, id));
  }
  return std::unique_ptr<PutSink>(new HeapSink(*e, id, bytes));
}

absl::StatusOr<std::unique_ptr<cluster::PeerService::GetSource>> EnginePeerService::BeginGet(
    const ObjectKey& id) {
  if (auto s = OnlyWholeChunks(id); !s.ok()) return s;
  auto e = Engine();
  if (!e.ok()) return e.status();
  PlacementEngine* eng = *e;
  // A peer's get is a read of this node's engine like a local client's (a
  // use of the chunk, counted in gets and hits). From the pool when there
  // is one: zero copy for a chunk whole in DRAM.
  tiering::GetOptions go;
  go.allow_remote = false;
  if (eng->dram() != nullptr) {
    auto r = eng->GetShared(id.key, /*ttl_ms=*/0, go);
    if (!r.ok()) return r.status();
    return std::unique_ptr<GetSource>(new SharedSource(eng, *r));
  }
  auto n = eng->ChunkBytes(id.key, /*allow_remote=*/false);
  if (!n.ok()) return n.status();
  std::vector<uint8_t> buf(*n);
  auto got = eng->Get(id.key, buf, go);
  if (!got.ok()) return got.status();
  return std::unique_ptr<GetSource>(new HeapSource(std::move(buf)));
}

absl::StatusOr<uint64_t> EnginePeerService::Size(const ObjectKey& id) {
  if (auto s = OnlyWholeChunks(id); !s.ok()) return s;
  auto e = Engine();
  if (!e.ok()) return e.status();
  return (*e)->ChunkBytes(id.key, /*allow_remote=*/false);
}

absl::Status EnginePeerService::Erase(const ObjectKey& id) {
  if (auto s = OnlyWholeChunks(id); !s.ok()) return s;
  auto e = Engine();
  if (!e.ok()) return e.status();
  tiering::DeleteOptions d;
  d.local_only = true;
  return (*e)->Delete(id.key, d);
}

}  // namespace kvtier::server
