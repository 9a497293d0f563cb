# End-to-end tests of `kvtier replay` and `kvtier plan`: the built binary on
# traces the tests write to a temp dir, and `replay --live` against kvtierd.
kvtier_add_test(replay_cli_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/replay_cli_test.cc
  DEPS kvtier_common nlohmann_json::nlohmann_json
  TIMEOUT 120)
target_compile_definitions(replay_cli_test PRIVATE
  KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>" KVTIERD_PATH="$<TARGET_FILE:kvtierd>")
add_dependencies(replay_cli_test kvtier kvtierd)
