# Glue for external packages; nothing here is copied source. Included (not add_subdirectory) from the top level
# so that the imported targets are visible everywhere.

find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog REQUIRED)
find_package(METIS REQUIRED)
find_package(ZLIB REQUIRED)
find_package(GlooHeaders REQUIRED)

# LibTorch comes from the pip `torch` wheel; scripts/setup.sh passes its torch.utils.cmake_prefix_path.
find_package(Torch REQUIRED)
# TORCH_LIBRARIES carries the wheel's compile flags and definitions (USE_C10D_GLOO among them).
add_library(smp_torch INTERFACE)
add_library(smp::torch ALIAS smp_torch)
target_link_libraries(smp_torch INTERFACE ${TORCH_LIBRARIES} smp::gloo_headers)

# The NCCL path is compiled whenever LibTorch was built with CUDA and NCCL is found: both are on the build
# machines, GPU or not, so CI compiles and links it. Without them comm/ builds a stand-in that says why.
find_package(NCCL)
set(SMP_WITH_NCCL OFF)
if(NCCL_FOUND AND TARGET c10_cuda)
  set(SMP_WITH_NCCL ON)
endif()
message(STATUS "smp: NCCL path: ${SMP_WITH_NCCL} (${NCCL_LIBRARY})")
