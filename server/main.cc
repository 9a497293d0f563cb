// kvtierd: the kvtier sidecar daemon. See docs/daemon.md.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "CLI/CLI.hpp"
#include "server/daemon.h"
#include "server/options.h"
#include "server/tcp_acceptor.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  using namespace kvtier::server;
  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and only sigwait below sees them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  DaemonOptions opts;
  CLI::App app{"kvtierd: the kvtier KV-cache sidecar daemon (gRPC on a Unix socket, shared-memory "
               "data plane, DRAM + NVMe tiers, HBM with a GPU)"};
  RegisterDaemonFlags(app, &opts);
  // The config file is applied first; the flags given then override it.
  for (int i = 1; i + 1 < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config") {
      DaemonOptions from_file;
      if (absl::Status st = LoadConfigFile(argv[i + 1], &opts); !st.ok()) {
        std::fprintf(stderr, "kvtierd: %s\n", std::string(st.message()).c_str());
        return 2;
      }
    } else if (a.rfind("--config=", 0) == 0) {
      if (absl::Status st = LoadConfigFile(a.substr(9), &opts); !st.ok()) {
        std::fprintf(stderr, "kvtierd: %s\n", std::string(st.message()).c_str());
        return 2;
      }
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  spdlog::set_level(spdlog::level::from_str(opts.log_level));
  // Every connection and open file takes a descriptor; the soft limit is
  // often 1024 while the hard one allows far more.
  if (auto limit = RaiseFdLimitToHard(); limit.ok()) {
    spdlog::info("kvtierd: file descriptor limit (RLIMIT_NOFILE) {}", *limit);
  } else {
    spdlog::warn("kvtierd: {}", std::string(limit.status().message()));
  }
  auto daemon = Daemon::Start(opts);
  if (!daemon.ok()) {
    std::fprintf(stderr, "kvtierd: %s\n", std::string(daemon.status().message()).c_str());
    return 2;
  }
  spdlog::info("kvtierd serving on {}", (*daemon)->Describe());
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("kvtierd: signal {}: shutting down", sig);
  absl::Status st = (*daemon)->Shutdown();
  spdlog::info("kvtierd: wrote {} DRAM chunks to NVMe; index flushed", (*daemon)->flushed_chunks());
  if (!st.ok()) {
    spdlog::error("kvtierd: shutdown: {}", std::string(st.message()));
    return 2;
  }
  return 0;
}
