kvtier_add_test(codec_cli_test
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/codec_cli_test.cc
  DEPS kvtier_codec kvtier_npy)
target_compile_definitions(codec_cli_test PRIVATE KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>")
add_dependencies(codec_cli_test kvtier)
