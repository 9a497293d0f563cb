// kvtier: the command-line tool of the kvtier KV-cache service.
#include <cstdio>
#include <exception>

#include "cli/cli.h"

int main(int argc, char** argv) {
  using namespace kvtier::cli;
  CLI::App app{"kvtier: tiered KV-cache storage for LLM inference (codec, keys, bandwidth model)"};
  app.require_subcommand(1);
  CommandResult result;
  RegisterCodecCommands(app, result);
  RegisterDaemonCommands(app, result);
  RegisterBandwidthCommands(app, result);
  RegisterClusterCommands(app, result);
  RegisterReplayCommands(app, result);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line, like every other failure (CLI11's own report adds a second).
    std::fprintf(stderr, "kvtier: %s (see --help)\n", e.what());
    return kExitError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtier: %s\n", e.what());
    return kExitError;
  }
  return result.exit_code;
}
