// A kvtierd child process for end-to-end tests of the real binaries: spawned
// on a temp data dir with small tiers, ready when its --ready-file appears,
// killed (SIGKILL) if still running when the object goes away.
// REQUIRES: the including test defines KVTIERD_PATH (the daemon binary).
#ifndef KVTIER_TESTS_DAEMON_PROCESS_H_
#define KVTIER_TESTS_DAEMON_PROCESS_H_

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "common/testing/wait.h"

namespace kvtier::testing {

class DaemonProcess {
 public:
  struct Options {
    // Flags after the defaults; a flag named here replaces its default.
    std::vector<std::string> extra_args;
    // RLIMIT_NOFILE set in the child before exec: the soft limit, and the
    // hard one (0: the same). 0 keeps the test's.
    uint64_t fd_limit = 0;
    uint64_t fd_hard_limit = 0;
  };
  explicit DaemonProcess(const std::string& dir) : DaemonProcess(dir, Options{}) {}
  DaemonProcess(const std::string& dir, const Options& options)
      : dir_(dir), ready_(dir + "/kvtierd.ready") {
    ::unlink(ready_.c_str());  // a killed daemon leaves its file behind
    // Each default (flag, value) unless extra_args names the flag itself.
    const std::vector<std::pair<std::string, std::string>> defaults = {
        {"--data-dir", dir + "/data"}, {"--dram-gib", "0.03125"}, {"--nvme-gib", "0.0625"},
        {"--hbm-gib", "0"},           {"--dram-populate", "false"}, {"--ready-file", ready_}};
    std::vector<std::string> args = {KVTIERD_PATH};
    for (const auto& [flag, value] : defaults) {
      if (std::find(options.extra_args.begin(), options.extra_args.end(), flag) !=
          options.extra_args.end()) {
        continue;
      }
      args.push_back(flag);
      args.push_back(value);
    }
    args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      std::string log = dir + "/kvtierd.log";
      FILE* f = std::freopen(log.c_str(), "a", stderr);
      (void)f;
      std::freopen(log.c_str(), "a", stdout);
      if (options.fd_limit > 0) {
        rlimit r{options.fd_limit, options.fd_hard_limit > 0 ? options.fd_hard_limit : options.fd_limit};
        if (::setrlimit(RLIMIT_NOFILE, &r) != 0) ::_exit(126);
      }
      ::execv(KVTIERD_PATH, argv.data());
      ::_exit(127);
    }
  }
  ~DaemonProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  std::string socket() const { return dir_ + "/data/kvtierd.sock"; }
  // The TCP port from the ready file's description ("tcp port N"); 0
  // without a TCP listener. REQUIRES: WaitReady() returned true.
  int tcp_port() const {
    std::ifstream in(ready_);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = text.find("tcp port ");
    return at == std::string::npos ? 0 : std::atoi(text.c_str() + at + 9);
  }
  pid_t pid() const { return pid_; }
  // Waits (up to 20 s) until the daemon reports every listener serving
  // (--ready-file); false at once if it exited instead.
  bool WaitReady() {
    return WaitUntil([&] { return FileExists(ready_) || Exited(); }, std::chrono::seconds(20)) &&
           FileExists(ready_);
  }
  // SIGKILL, reaped.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // SIGTERM and the exit status (-1 if it did not exit within 20 s).
  int Terminate() {
    ::kill(pid_, SIGTERM);
    if (!WaitUntil([&] { return Exited(); }, std::chrono::seconds(20))) return -1;
    return exit_code_;
  }

 private:
  static bool FileExists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }
  // Reaps the child if it has exited, keeping its exit code.
  bool Exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
    pid_ = -1;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }

  std::string dir_, ready_;
  pid_t pid_ = -1;
  int exit_code_ = -1;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_DAEMON_PROCESS_H_
