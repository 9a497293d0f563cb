// Runs a command line in a shell and captures its exit status, stdout and
// stderr, for end-to-end tests of the `kvtier` tool.
#ifndef KVTIER_TESTS_CLI_RUNNER_H_
#define KVTIER_TESTS_CLI_RUNNER_H_

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace kvtier::testing {

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `command` (a shell command line) with stdout and stderr captured
// through temp files in `dir`.
inline CliResult RunCommand(const std::string& command, const std::string& dir) {
  std::string out = dir + "/stdout", err = dir + "/stderr";
  std::string full = command + " >" + out + " 2>" + err;
  int status = std::system(full.c_str());
  CliResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = ReadAll(out);
  r.err = ReadAll(err);
  return r;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_CLI_RUNNER_H_
