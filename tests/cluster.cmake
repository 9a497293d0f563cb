# Cluster end-to-end: three kvtierd processes and a private etcd on
# loopback.
kvtier_add_test(cluster_e2e_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/cluster_e2e_test.cc
  DEPS kvtier_codec kvtier_cluster_peer kvtier_cluster nlohmann_json::nlohmann_json
  TIMEOUT 180)
target_compile_definitions(cluster_e2e_test PRIVATE
  KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>" KVTIERD_PATH="$<TARGET_FILE:kvtierd>")
add_dependencies(cluster_e2e_test kvtier kvtierd)
