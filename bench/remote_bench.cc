// Remote-tier benchmark: put/get GB/s of 24 MiB chunks between two kvtier
// transports in two processes on loopback, as a fraction of ucx_perftest's
// active-message bandwidth with the same transport selection and message
// size, measured in the same run; each transport both without and with the
// cluster secret (peer authentication), with the time a fresh connection
// takes to serve its first request either way. Last, what encrypting the
// payload would cost: one core's AES-256-GCM throughput on a chunk (OpenSSL
// EVP), the AEAD kvtier would use, against the transport's GB/s.
//
// Usage: remote_bench [--json FILE] [--iters N] [--tls LIST ...]
//   --tls takes a UCX_TLS value (e.g. "tcp"); each is benchmarked in turn
//   (default: "tcp", the transport kvtier's endpoints run on; see main()).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <openssl/evp.h>

#include "bench/bench_util.h"
#include "cluster/ucx_transport.h"

using namespace kvtier;
using namespace kvtier::tiering;
using namespace kvtier::cluster;

namespace {

constexpr size_t kChunk = 24u << 20;  // a 256-token Llama-3.1-8B K16/V8 chunk is 24.0 MiB
// A cluster secret for the authenticated runs (both processes hold it).
const std::string kBenchSecret = "remote-bench-secret-0123456789abcdef0123456789";

UcxTransportOptions Options(const std::string& listen, bool auth) {
  UcxTransportOptions o;
  o.listen = listen;
  if (auth) {
    o.cluster_secret = kBenchSecret;
    o.node_id = listen.empty() ? "bench-client" : "bench-server";
  }
  return o;
}

// The receiving side of the benchmark: objects land in one pre-faulted,
// registered buffer, as they land in the daemon's DRAM pool (a fresh heap
// buffer per put would measure page faults, not the transport).
class PoolPeerService : public PeerService {
 public:
  explicit PoolPeerService(size_t bytes) : pool_(bytes, 1) {}
  std::span<uint8_t> pool() { return pool_; }
  class Sink : public PutSink {
   public:
    Sink(PoolPeerService* s, uint64_t n) : s_(s), n_(n) {}
    std::span<uint8_t> buffer() override { return {s_->pool_.data(), n_}; }
    absl::Status Commit(bool ok) override {
      if (ok) s_->size_ = n_;
      return absl::OkStatus();
    }

   private:
    PoolPeerService* s_;
    uint64_t n_;
  };
  class Source : public GetSource {
   public:
    explicit Source(std::span<const uint8_t> b) : b_(b) {}
    std::span<const uint8_t> bytes() override { return b_; }

   private:
    std::span<const uint8_t> b_;
  };
  absl::StatusOr<std::unique_ptr<PutSink>> BeginPut(const ObjectKey&, uint64_t bytes) override {
    if (bytes > pool_.size()) return absl::ResourceExhaustedError("pool too small");
    return std::unique_ptr<PutSink>(new Sink(this, bytes));
  }
  absl::StatusOr<std::unique_ptr<GetSource>> BeginGet(const ObjectKey&) override {
    return std::unique_ptr<GetSource>(new Source({pool_.data(), size_}));
  }
  absl::StatusOr<uint64_t> Size(const ObjectKey&) override { return size_; }
  absl::Status Erase(const ObjectKey&) override { return absl::OkStatus(); }

 private:
  std::vector<uint8_t> pool_;
  std::atomic<uint64_t> size_{0};
};

// Runs the server side in a child process; returns its pid and its UCX
// worker address (what cluster members publish in etcd).
pid_t StartServer(std::string* address, bool auth) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    PoolPeerService service(kChunk);
    auto t = UcxTransport::Create(Options("127.0.0.1:0", auth), &service);
    if (t.ok() && !(*t)->RegisterMemory(service.pool().data(), service.pool().size()).ok()) _exit(1);
    std::string a = t.ok() ? (*t)->worker_address() : "";
    a.push_back('\n');
    if (write(fds[1], a.data(), a.size()) < 0) _exit(1);
    close(fds[1]);
    pause();  // until the parent kills it
    _exit(0);
  }
  close(fds[1]);
  std::string a;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) a.append(buf, n);
  close(fds[0]);
  while (!a.empty() && a.back() == '\n') a.pop_back();
  *address = a;
  return pid;
}

// ucx_perftest ucp_am_bw with `bytes` messages; returns decimal GB/s or -1.
double PerftestGBps(size_t bytes, int iters, const std::string& tls) {
  int port = 20000 + (getpid() % 20000);
  std::string env = tls.empty() ? "" : "UCX_TLS=" + tls + " ";
  std::string server = env + "timeout 120 ucx_perftest -p " + std::to_string(port) +
                       " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return -1;
  usleep(500000);
  std::string client = env + "timeout 120 ucx_perftest 127.0.0.1 -p " + std::to_string(port) +
                       " -t ucp_am_bw -s " + std::to_string(bytes) + " -n " +
                       std::to_string(iters) + " -w 3 2>&1";
  FILE* p = popen(client.c_str(), "r");
  if (!p) return -1;
  char line[1024];
  double mbps = -1;
  while (fgets(line, sizeof(line), p)) {
    if (std::strncmp(line, "Final:", 6) == 0) {
      // Final: iters  lat50 lat_avg lat_overall  bw_avg bw_overall  rate_avg rate_overall
      double v[8];
      if (std::sscanf(line + 6, "%lf %lf %lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3],
                      &v[4], &v[5], &v[6], &v[7]) == 8) {
        mbps = v[5];
      }
    }
  }
  pclose(p);
  // ucx_perftest reports MB/s as 2^20 bytes per second.
  return mbps < 0 ? -1 : mbps * 1048576.0 / 1e9;
}

// One core's AES-256-GCM encryption of a chunk, GB/s (best of 5), or -1.
double AesGcmGBps() {
  std::vector<uint8_t> in(kChunk, 0x5a), out(kChunk);
  uint8_t key[32] = {1}, iv[12] = {2}, tag[16];
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  bool ok = ctx != nullptr;
  double s = bench::BestSeconds(5, [&] {
    int n = 0;
    ok = ok && EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key, iv) == 1 &&
         EVP_EncryptUpdate(ctx, out.data(), &n, in.data(), static_cast<int>(in.size())) == 1 &&
         EVP_EncryptFinal_ex(ctx, out.data() + n, &n) == 1 &&
         EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, sizeof(tag), tag) == 1;
  });
  EVP_CIPHER_CTX_free(ctx);
  return ok ? kChunk / s / 1e9 : -1;
}

// Mean time (microseconds) a fresh client transport takes to answer its
// first Size request to `addr` (connection, probe or handshake, request),
// over `n` fresh transports.
double FirstRequestUs(const std::string& addr, bool auth, int n) {
  ObjectKey id{Hash128::Of(std::string_view("bench"), 0), Part::kWhole};
  double total = 0;
  for (int i = 0; i < n; ++i) {
    auto c = UcxTransport::Create(Options("", auth), nullptr);
    if (!c.ok()) return -1;
    auto t0 = std::chrono::steady_clock::now();
    if (!(*c)->Size(addr, id, absl::Seconds(10)).ok()) return -1;
    total += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  return total / n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int iters = 30;
  std::vector<std::string> tls_list;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--tls") && i + 1 < argc) tls_list.push_back(argv[++i]);
  }
  // kvtier's endpoints ask for peer-failure detection, which UCX 1.13 offers
  // on tcp but not on shared-memory transports: tcp is the same-transport
  // baseline. `--tls ""` adds UCX's automatic choice for reference.
  if (tls_list.empty()) tls_list = {"tcp"};
  std::printf("machine: %s\n", bench::CpuName().c_str());
  std::printf("object: %zu bytes (24 MiB), %d iterations, best-of-3 runs\n\n", kChunk, iters);
  std::printf("%-18s %5s %10s %10s %10s %10s %10s %12s\n", "UCX_TLS", "auth", "perftest", "put GB/s",
              "put/pt", "get GB/s", "get/pt", "1st req us");
  std::printf("load average at start: %s\n", bench::LoadAverage().c_str());
  std::string json = "{\"benchmark\":\"remote_tier\",\"load_average\":\"" + bench::LoadAverage() +
                     "\",\"connect\":\"ucx worker address\",\"machine\":\"" + bench::CpuName() +
                     "\",\"object_bytes\":" + std::to_string(kChunk) + ",\"results\":[";
  bool first = true;
  for (const std::string& tls : tls_list) {
    if (tls.empty()) {
      unsetenv("UCX_TLS");
    } else {
      setenv("UCX_TLS", tls.c_str(), 1);
    }
    double pt = PerftestGBps(kChunk, iters, tls);
    for (bool auth : {false, true}) {
      std::string addr;
      pid_t server = StartServer(&addr, auth);
      if (server < 0 || addr.empty()) {
        std::fprintf(stderr, "could not start the server transport\n");
        return 2;
      }
      auto client = UcxTransport::Create(Options("", auth), nullptr);
      if (!client.ok()) {
        std::fprintf(stderr, "client: %s\n", std::string(client.status().message()).c_str());
        return 2;
      }
      std::vector<uint8_t> buf(kChunk, 7), out(kChunk);
      if (!(*client)->RegisterMemory(buf.data(), buf.size()).ok() ||
          !(*client)->RegisterMemory(out.data(), out.size()).ok()) {
        return 2;
      }
      ObjectKey id{Hash128::Of(std::string_view("bench"), 0), Part::kWhole};
      for (int w = 0; w < 3; ++w) {
        absl::Status s = (*client)->Put(addr, id, buf, absl::Seconds(30));
        if (s.ok()) s = (*client)->Get(addr, id, out, absl::Seconds(30));
        if (!s.ok()) {
          std::fprintf(stderr, "warm-up transfer failed: %s\n", std::string(s.message()).c_str());
          return 2;
        }
      }
      double put_s = bench::BestSeconds(3, [&] {
        for (int i = 0; i < iters; ++i) {
          if (!(*client)->Put(addr, id, buf, absl::Seconds(30)).ok()) std::abort();
        }
      });
      double get_s = bench::BestSeconds(3, [&] {
        for (int i = 0; i < iters; ++i) {
          if (!(*client)->Get(addr, id, out, absl::Seconds(30)).ok()) std::abort();
        }
      });
      client->reset();
      const double first_us = FirstRequestUs(addr, auth, 20);
      kill(server, SIGKILL);
      waitpid(server, nullptr, 0);
      double put = kChunk * double(iters) / put_s / 1e9, get = kChunk * double(iters) / get_s / 1e9;
      std::string name = tls.empty() ? "auto" : tls;
      std::printf("%-18s %5s %10.2f %10.2f %10.3f %10.2f %10.3f %12.0f\n", name.c_str(), auth ? "yes" : "no", pt,
                  put, pt > 0 ? put / pt : 0, get, pt > 0 ? get / pt : 0, first_us);
      json += std::string(first ? "" : ",") + "{\"ucx_tls\":\"" + name + "\",\"peer_auth\":" +
              (auth ? "true" : "false") + ",\"perftest_am_bw_gbps\":" +
              std::to_string(pt) + ",\"put_gbps\":" + std::to_string(put) + ",\"get_gbps\":" +
              std::to_string(get) + ",\"put_vs_perftest\":" + std::to_string(pt > 0 ? put / pt : 0) +
              ",\"get_vs_perftest\":" + std::to_string(pt > 0 ? get / pt : 0) +
              ",\"first_request_us\":" + std::to_string(first_us) + "}";
      first = false;
    }
  }
  const double aes = AesGcmGBps();
  json += "],\"aes_256_gcm_one_core_gbps\":" + std::to_string(aes) + "}\n";
  std::printf("\nAES-256-GCM, one core, %zu-byte chunk (OpenSSL EVP): %.2f GB/s\n", kChunk, aes);
  std::printf("\nGB/s are decimal (1e9 bytes/s). Baseline: ucx_perftest -t ucp_am_bw, same UCX_TLS and size.\n"
              "1st req us: a fresh connection's first Size request (connect + probe, or + handshake with auth).\n");
  return bench::WriteJson(json_path, json) ? 0 : 2;
}
