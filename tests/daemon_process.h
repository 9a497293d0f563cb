// A kvtierd child process for end-to-end tests of the real binaries: spawned
// on a temp data dir with small tiers, ready when its --ready-file appears,
// killed (SIGKILL) if still running when the object goes away.
// REQUIRES: the including test defines KVTIERD_PATH (the daemon binary).
#ifndef KVTIER_TESTS_DAEMON_PROCESS_H_
#define KVTIER_TESTS_DAEMON_PROCESS_H_

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "common/testing/wait.h"

namespace kvtier::testing {

class DaemonProcess {
 public:
  explicit DaemonProcess(const std::string& dir) : dir_(dir), ready_(dir + "/kvtierd.ready") {
    ::unlink(ready_.c_str());  // a killed daemon leaves its file behind
    pid_ = ::fork();
    if (pid_ == 0) {
      std::string log = dir + "/kvtierd.log";
      FILE* f = std::freopen(log.c_str(), "a", stderr);
      (void)f;
      std::freopen(log.c_str(), "a", stdout);
      ::execl(KVTIERD_PATH, KVTIERD_PATH, "--data-dir", (dir + "/data").c_str(), "--dram-gib",
              "0.03125", "--nvme-gib", "0.0625", "--hbm-gib", "0", "--dram-populate", "false",
              "--ready-file", ready_.c_str(), static_cast<char*>(nullptr));
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
  pid_t pid() const { return pid_; }
  // Waits (up to 20 s) until the daemon reports every listener serving
  // (--ready-file); false at once if it exited instead.
  bool WaitReady() {
    return WaitUntil([&] { return FileExists(ready_) || Exited(); }, std::chrono::seconds(20)) &&
           FileExists(ready_);
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
