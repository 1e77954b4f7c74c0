# Included after each project() of the llama-cpp-python build (setup.sh passes it as
# CMAKE_PROJECT_INCLUDE): llama-cpp-python forces llama.cpp's common library on, which
# neither its Python package nor this project loads, and which takes the largest share
# of the build's compile time. llama.cpp's own project() comes after that force, so the
# library is left out there.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp's common library: unused here" FORCE)
