# Tiering integration, fault-injection and crash tests.
kvtier_add_test(tiering_nvme_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/tiering_nvme_test.cc
  DEPS kvtier_tiering
  TIMEOUT 120)
kvtier_add_test(tiering_crash_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/tiering_crash_test.cc
  DEPS kvtier_tiering
  TIMEOUT 120)
kvtier_add_test(tiering_gpu_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/tiering_gpu_test.cc
  DEPS kvtier_tiering
  LABELS gpu
  TIMEOUT 60)
