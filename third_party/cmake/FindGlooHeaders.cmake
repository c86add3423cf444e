# The torch wheel ships libtorch_cpu with Gloo compiled in, and c10d's ProcessGroupGloo.hpp, but not the Gloo
# headers that ProcessGroupGloo.hpp includes. Debian's libgloo-dev provides them; we only use them for
# declarations (no Gloo library is linked: the symbols we call live in libtorch_cpu).
find_path(GLOO_INCLUDE_DIR gloo/algorithm.h)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(GlooHeaders REQUIRED_VARS GLOO_INCLUDE_DIR)
if(GlooHeaders_FOUND AND NOT TARGET smp::gloo_headers)
  add_library(smp::gloo_headers INTERFACE IMPORTED)
  set_target_properties(smp::gloo_headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${GLOO_INCLUDE_DIR}")
endif()
mark_as_advanced(GLOO_INCLUDE_DIR)
