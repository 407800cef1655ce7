// Linked with two_tu_b.cpp: an inline variable or function defined in a
// header without `inline` would be a duplicate symbol here.
#include <gradsync/gradsync.hpp>

#include <span>
#include <vector>

int a_main()
{
    gradsync::bfloat16 half(1.0f);
    if (static_cast<float>(half) != 1.0f) return 1;
    gradsync::run_threads(2, [](auto& comm) {
        std::vector<float> x(3, 1.0f);
        gradsync::AllReduce<gradsync::Ring>{}(comm, std::span<float>(x));
    });
    return 0;
}
