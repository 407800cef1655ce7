// The second translation unit: same headers, a different instantiation.
#include <gradsync/gradsync.hpp>

#include <span>
#include <vector>

int a_main();

static int b_main()
{
    gradsync::bfloat16 half(2.0f);
    if (static_cast<float>(half) != 2.0f) return 1;
    gradsync::run_threads(2, [](auto& comm) {
        std::vector<float> x(3, 1.0f);
        gradsync::AllReduce<gradsync::Native>{}(comm, std::span<float>(x));
    });
    return 0;
}

int main()
{
    return a_main() + b_main();
}
