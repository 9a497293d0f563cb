# End-to-end tests of the bandwidth commands of the `kvtier` tool
# (shortfall, models, links, probe): the built binary, its output and exit codes.
kvtier_add_test(bandwidth_cli_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bandwidth_cli_test.cc
  DEPS kvtier_bandwidth)
target_compile_definitions(bandwidth_cli_test PRIVATE
  KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>"
  KVTIER_BANDWIDTH_TESTDATA="${PROJECT_SOURCE_DIR}/bandwidth/testdata")
add_dependencies(bandwidth_cli_test kvtier)
